"""`midtrain rl`: the RL trainer (megatron-core on the policy checkpoint), its batches and their split across ranks,
the step's math (mismatch metrics, corrections, losses), and the entry point wired to Kafka."""
