"""Routed-experts overhead at a realistic routing shape: 61 MoE layers, top-8 of 256 experts.

Measured: the routed experts' bytes per token on the wire (one Rollout, raw and zstd-compressed as the
producers send it) and in the TrainBatch (encoded, and as the uint8 tensor the trainer gets); the
decode time of a batch (into the trainer's `RLBatch` tensors) with and without them; and the RL step
time (forward + backward + optimizer step of the megatron-core MoE on CPU, on in-memory batches, no
broker) with router replay forcing the experts, with replay off (the experts only compared) and
without experts in the batch. The step is timed around the whole `train_step` call, which includes
the per-layer comparison of the trainer's routing with the sampler's (the routing-disagreement
metric, computed whenever the batch carries experts); that comparison is also timed where it runs
(`routing_compare_seconds`), so: replay's cost = replay - off, the comparison's = its own time,
the experts' total = replay - no experts. The configurations alternate within each repeat and the
differences are medians of per-repeat pairs, so a drifting machine load cancels. The model has the
61 x 256 x top-8 routing shape but a tiny hidden size, so the step times show the replay overhead,
not a real step's cost. Timing never decides pass/fail.

    .venv/bin/python bench/bench_router_replay.py [--tokens 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.midtrain.rl.batch import rl_batch  # noqa: E402
from ember.rollouts.batching import ScoredRollout, build_train_batch  # noqa: E402
from ember.rollouts.simulate import synthetic_rollout  # noqa: E402
from ember.schemas import decode_train_batch, encode, encode_train_batch  # noqa: E402

TOP_K, EXPERTS = 8, 256


def distinct_topk(rng: np.random.Generator, tokens: int, layers: int) -> np.ndarray:
    """[tokens, layers, 8] uint8: per token and layer, 8 distinct experts (what a router emits)."""
    out = np.empty((tokens, layers, TOP_K), dtype=np.uint8)
    for layer in range(layers):
        out[:, layer] = rng.random((tokens, EXPERTS)).argpartition(TOP_K, axis=1)[:, :TOP_K]
    return out


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wire_and_batch(tokens: int, sequences: int, repeats: int, layers: int):
    rng = np.random.default_rng(0)
    per_seq = tokens // sequences
    rollouts = []
    for i in range(sequences):
        r = synthetic_rollout(rng, group_id="g", prompt_id="p", num_tokens=per_seq, prompt_tokens=per_seq // 4, layers=None, rollout_id=f"r{i}")
        rollouts.append(dataclasses.replace(r, routed_experts=distinct_topk(rng, per_seq, layers)))
    zstd = zstandard.ZstdCompressor(level=3)
    with_e, without_e = encode(rollouts[0]), encode(dataclasses.replace(rollouts[0], routed_experts=None))
    wire = (len(with_e) - len(without_e)) / per_seq
    wire_zstd = (len(zstd.compress(with_e)) - len(zstd.compress(without_e))) / per_seq

    def batch(with_experts: bool):
        chosen = [r if with_experts else dataclasses.replace(r, routed_experts=None) for r in rollouts]
        return build_train_batch([ScoredRollout(r, 1.0) for r in chosen], step=0, source_offsets=[], created_at_us=0)

    encoded = {flag: encode_train_batch(batch(flag)) for flag in (True, False)}
    in_batch = (len(encoded[True]) - len(encoded[False])) / (per_seq * sequences)
    decode = {flag: median_s(lambda m=encoded[flag]: rl_batch(decode_train_batch(m)), repeats * 5) for flag in (True, False)}
    tensor_bytes = rl_batch(decode_train_batch(encoded[True])).routed_experts.element_size() * layers * TOP_K
    return batch(True), wire, wire_zstd, in_batch, tensor_bytes, decode


def step_times(batch, repeats: int, layers: int) -> tuple[dict[str, list[float]], list[float]]:
    """Per configuration, the wall time of each `train_step`; and the routing comparison's time per replay step."""
    from ember.midtrain.config import parse_rl_config
    from ember.midtrain.rl.trainer import RLTrainer

    root = Path(tempfile.mkdtemp(prefix="bench-replay-"))
    config = parse_rl_config(
        {
            "run_dir": str(root),
            "model": {"tokenizer": "bench", "vocab_size": int(batch.tokens.max()) + 1, "seq_len": 4096,
                      "num_layers": layers, "hidden_size": 32, "num_attention_heads": 4},
            "moe": {"num_experts": EXPERTS, "router_topk": TOP_K, "ffn_hidden_size": 16, "load_balancing": "none"},
            "optimizer": {"lr": 1e-5},
            "rollouts": {"topic_prefix": "bench"},
            "rl": {"steps": 1000, "replay": "replay", "correction": "tis"},
        },
        root,
    )
    trainer = RLTrainer(config)
    with_experts = rl_batch(batch)
    no_experts = with_experts.without_routed_experts()
    off = trainer.config.model_copy(update={"rl": trainer.config.rl.model_copy(update={"replay": "off"})})
    on = trainer.config
    results: dict[str, list[float]] = {"replay": [], "off (compare only)": [], "no experts in batch": []}
    compare: list[float] = []
    trainer.train_step(with_experts)  # warm-up
    for _ in range(repeats):
        for name, cfg, b in (("replay", on, with_experts), ("off (compare only)", off, with_experts), ("no experts in batch", on, no_experts)):
            trainer.config = cfg
            t0 = time.perf_counter()
            record = trainer.train_step(b)
            results[name].append(time.perf_counter() - t0)
            if name == "replay":
                assert record["routing_disagreement"] == 0.0
                compare.append(record["routing_compare_seconds"])
            if name == "no experts in batch":
                assert record["routing_compare_seconds"] == 0.0, "no experts, nothing to compare"
    trainer.config = on
    trainer.close()
    return results, compare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens per batch (quick 256, full 1024)")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--layers", type=int, default=None,
                        help="MoE layers (quick 4: ten CPU steps of 16 layers x 256 sequential experts ran past 240 s; full 61)")
    parser.add_argument("--repeats", type=int, default=3)
    add_flags(parser)
    args = parser.parse_args()
    args.tokens = args.tokens or profile_default(args.profile, 256, 1024)
    args.layers = args.layers or profile_default(args.profile, 4, 61)
    batch, wire, wire_zstd, in_batch, tensor_bytes, decode = wire_and_batch(args.tokens, args.sequences, args.repeats, args.layers)
    print(f"routing shape: {args.layers} layers x top-{TOP_K} of {EXPERTS} experts (uint8); batch {args.tokens} tokens, {args.sequences} sequences")
    print(f"routed experts on the wire (Rollout):     {wire:.1f} B/token raw, {wire_zstd:.1f} B/token zstd-3")
    print(f"routed experts in the TrainBatch:         {in_batch:.1f} B/token encoded, {tensor_bytes} B/token as the trainer's tensor")
    print(f"batch decode + tensors:                   {decode[True] * 1e3:.2f} ms with experts, {decode[False] * 1e3:.2f} ms without "
          f"(+{(decode[True] - decode[False]) * 1e3:.2f} ms)")
    steps, compare = step_times(batch, args.repeats, args.layers)
    med = statistics.median
    base = med(steps["no experts in batch"])
    for name, seconds in steps.items():
        print(f"RL step ({name}):{' ' * (24 - len(name))}{med(seconds):.3f} s  ({(med(seconds) / base - 1) * 100:+.1f}% vs no experts)")
    replay_step = med(steps["replay"])

    def paired(a: str, b: str) -> float:
        return med([x - y for x, y in zip(steps[a], steps[b])])

    for what, seconds in (
        ("forcing the experts (replay - off)", paired("replay", "off (compare only)")),
        ("routing comparison (timed where it runs)", med(compare)),
        ("experts in the batch, all (replay - no experts)", paired("replay", "no experts in batch")),
    ):
        print(f"cost of {what}:{' ' * (48 - len(what))}{seconds:+.3f} s  ({seconds / replay_step * 100:+.1f}% of the replay step)")
    write_results(args.results, "bench_router_replay", args.profile, [
        Figure("RL step s, router replay on", "s", replay_step, base, "no experts in the batch", higher_is_better=False,
               repeats=args.repeats),
        Figure("batch decode ms, with routed experts", "ms", decode[True] * 1e3, decode[False] * 1e3, "without routed experts",
               higher_is_better=False, repeats=args.repeats * 5),
    ], tokens=args.tokens, sequences=args.sequences, layers=args.layers, wire_bytes_per_token={"raw": wire, "zstd": wire_zstd})


if __name__ == "__main__":
    main()
