"""`ember corpus build`: its config, reading sources into document rows, the per-document stages, dedup and
outputs, the checkpointed phases, the build driver, the report, and Dataflow template rendering."""
