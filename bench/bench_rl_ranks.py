"""RL beyond one rank: the RL step at world size 1 (the anchor) and 2 (data-parallel, and expert-parallel),
with router replay on, on the same encoded batch, and the bytes each rank decodes per step.

Each layout runs under torchrun (gloo on CPU) in its own process group: rank 0 hands out the encoded
batch, every rank decodes only its token-balanced share (`rl_batch_share`) and trains it; the loss is
aggregated over the whole batch. Printed: median step seconds per layout, the speed-up over one rank,
and per rank the bytes of per-token arrays and of routed experts it decoded (its share only, next to
the whole batch's). Timing never decides pass/fail; on a machine with fewer free cores than ranks the
ranks share cores and the speed-up says so.

    .venv/bin/python bench/bench_rl_ranks.py [--sequences 16] [--tokens-per-sequence 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
LAYERS, TOP_K, EXPERTS, VOCAB = 4, 2, 8, 512
LAYOUTS = {"1 rank": (1, 1), "2 ranks, data-parallel": (2, 1), "2 ranks, expert-parallel (EP 2)": (2, 2)}


def encoded_batch(sequences: int, per_sequence: int) -> bytes:
    """A TrainBatch of `sequences` rollouts, each with distinct top-k experts per token and layer."""
    from ember.schemas import TrainBatch, encode_train_batch

    rng = np.random.default_rng(0)
    n = sequences * per_sequence
    experts = np.stack(
        [rng.random((n, EXPERTS)).argpartition(TOP_K, axis=1)[:, :TOP_K] for _ in range(LAYERS)], axis=1
    ).astype(np.uint8)
    mask = np.tile(np.r_[np.zeros(per_sequence // 4), np.ones(per_sequence - per_sequence // 4)], sequences).astype(np.uint8)
    batch = TrainBatch(
        batch_id="bench", step=0, tokens=rng.integers(0, VOCAB, n).astype(np.uint32), loss_mask=mask,
        advantages=(rng.standard_normal(n) * mask).astype(np.float32),
        sampler_logprobs=(-rng.random(n) * mask).astype(np.float32),
        cu_seqlens=np.arange(0, n + 1, per_sequence, dtype=np.int32), policy_versions=np.zeros(sequences, np.int64),
        rollout_ids=[f"r{i}" for i in range(sequences)], routed_experts=experts,
    ).validate()
    return encode_train_batch(batch)


def worker(batch_path: str, run_dir: str, expert: int, steps: int, out: str) -> None:
    """One rank: the RL trainer on `steps` copies of the batch; rank 0 writes every step's record."""
    from ember.midtrain.config import parse_rl_config
    from ember.midtrain.rl.ranks import BatchMessage
    from ember.midtrain.rl.trainer import RLTrainer
    from ember.midtrain.runtime import StopRequest

    config = parse_rl_config(
        {
            "run_dir": run_dir,
            "model": {"tokenizer": "bench", "vocab_size": VOCAB, "seq_len": 4096, "num_layers": LAYERS,
                      "hidden_size": 64, "num_attention_heads": 4},
            "moe": {"num_experts": EXPERTS, "router_topk": TOP_K, "ffn_hidden_size": 128, "load_balancing": "none"},
            "parallel": {"expert": expert},
            "optimizer": {"lr": 1e-5},
            "rollouts": {"topic_prefix": "bench"},
            "rl": {"steps": steps, "replay": "replay", "correction": "tis"},
        },
        Path(run_dir),
    )
    trainer = RLTrainer(config)
    message = Path(batch_path).read_bytes()
    messages = [BatchMessage(message)] * steps if trainer.rank == 0 else None
    records = [trainer.train_step(b) for b in trainer.rank_batches(messages, StopRequest())]
    if trainer.rank == 0:
        Path(out).write_text(json.dumps(records))
    trainer.close()


def run_layout(batch_path: Path, ranks: int, expert: int, steps: int, root: Path) -> list[dict]:
    out = root / f"records-{ranks}-{expert}.json"
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, *launcher, __file__, "--worker", str(batch_path), str(root / f"run-{ranks}-{expert}"), str(expert),
         str(steps), str(out)],
        capture_output=True, text=True, env=env,
    )
    if result.returncode != 0:
        raise SystemExit(f"the {ranks}-rank run failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=None, help="default: quick 8, full 16")
    parser.add_argument("--tokens-per-sequence", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per layout, after one warm-up step")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    add_flags(parser)
    args = parser.parse_args()
    args.sequences = args.sequences or profile_default(args.profile, 8, 16)
    if args.worker:
        batch_path, run_dir, expert, steps, out = args.worker
        worker(batch_path, run_dir, int(expert), int(steps), out)
        return
    root = Path(tempfile.mkdtemp(prefix="bench-rl-ranks-"))
    batch_path = root / "batch.bin"
    batch_path.write_bytes(encoded_batch(args.sequences, args.tokens_per_sequence))
    tokens = args.sequences * args.tokens_per_sequence
    print(f"batch: {args.sequences} rollouts x {args.tokens_per_sequence} tokens, routed experts {LAYERS} layers x "
          f"top-{TOP_K} of {EXPERTS} (uint8); model {LAYERS} MoE layers, hidden 64; replay on; 1 thread per rank; "
          f"{os.cpu_count()} CPUs visible")
    anchor, figures = None, []
    layouts = profile_default(args.profile, dict(list(LAYOUTS.items())[:2]), LAYOUTS)  # quick: no expert-parallel run
    for name, (ranks, expert) in layouts.items():
        records = run_layout(batch_path, ranks, expert, args.repeats + 1, root)[1:]
        seconds = statistics.median(r["step_seconds"] for r in records)
        anchor = anchor or seconds
        if ranks > 1:
            figures.append(Figure(f"RL step tokens/s, {name}", "tokens/s", tokens / seconds, tokens / anchor, "1 rank",
                                  repeats=args.repeats))
        last = records[-1]
        assert last["routing_disagreement"] == 0.0 and last["tokens"] == tokens
        whole = sum(last["rank_decoded_bytes"])
        print(f"{name:<32} step {seconds:.3f} s median  {tokens / seconds:,.0f} tok/s  speed-up x{anchor / seconds:.2f} vs 1 rank")
        print(f"{'':<32} decoded per rank: {', '.join(f'{b:,} B' for b in last['rank_decoded_bytes'])} of {whole:,} B; "
              f"routed experts {', '.join(f'{b:,} B' for b in last['rank_routed_expert_bytes'])} of "
              f"{sum(last['rank_routed_expert_bytes']):,} B")
    write_results(args.results, "bench_rl_ranks", args.profile, figures, sequences=args.sequences,
                  tokens_per_sequence=args.tokens_per_sequence, cpus=os.cpu_count())


if __name__ == "__main__":
    main()
