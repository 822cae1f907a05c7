"""What announcing a policy version with its weights costs: export + announce against the checkpoint it follows.

Per repeat, on the same trainer state: the anchor is `RLTrainer.save()` (megatron dist checkpoint of model
and optimizer, what every checkpointed step already pays); ember's cost is what `run_rl` adds for an
announced version: `export_checkpoint` (read the checkpoint, rename to Mixtral's names, write safetensors +
config.json, fsync, sha256, atomic rename) and the announcement on the real broker (acked). Also the
sampler's side: `load_policy` (each file read once and hashed, config.json validated, safetensors parsed from
those bytes). Two sizes: the tests' toy policy and a larger one; CPU only. Timing never decides pass/fail.

    EMBER_HOME=/work/main/.ember .venv/bin/python bench/bench_policy_export.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402

SIZES = {
    "toy (2 layers, h32, 8 experts)": {},
    "small (4 layers, h256, 8 experts)": {"num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 512},
}


def _config(root: Path, prefix: str, sizes: dict):
    from ember.demo.sampler import toy_policy_config
    from ember.midtrain.config import parse_rl_config

    data = toy_policy_config(root, prefix, steps=10)
    data["model"].update({k: v for k, v in sizes.items() if k in ("num_layers", "hidden_size")})
    data["moe"].update({k: v for k, v in sizes.items() if k == "ffn_hidden_size"})
    return parse_rl_config(data, root)


def measure(name: str, sizes: dict, repeats: int) -> dict:
    from ember.midtrain.export_hf import export_checkpoint
    from ember.midtrain.hf_policy import load_policy
    from ember.midtrain.rl.run import PolicyVersionPublisher
    from ember.midtrain.rl.trainer import RLTrainer
    from ember.rollouts.config import kafka_bootstrap
    from ember.rollouts.records import PolicyVersion
    from ember.rollouts.security import KafkaSecurity

    root = Path(tempfile.mkdtemp(prefix="bench-export-"))
    config = _config(root, f"bench-export-{uuid.uuid4().hex[:8]}", sizes)
    trainer = RLTrainer(config)
    publisher = PolicyVersionPublisher(config.rollouts.topic_prefix, kafka_bootstrap(), KafkaSecurity())
    save, export, announce, load, size = [], [], [], [], 0
    try:
        for i in range(repeats + 1):  # the first round warms up
            t0 = time.perf_counter()
            path = trainer.save()
            t1 = time.perf_counter()
            done = export_checkpoint(path, root / "versions" / f"version_{i}", config.model, config.moe)
            t2 = time.perf_counter()
            publisher.publish(PolicyVersion.now(i, done.uri, done.sha256))
            t3 = time.perf_counter()
            load_policy(done.uri, done.sha256)
            t4 = time.perf_counter()
            if i:
                save.append(t1 - t0), export.append(t2 - t1), announce.append(t3 - t2), load.append(t4 - t3)
            size = (done.path / "model.safetensors").stat().st_size
    finally:
        publisher.close()
        trainer.close()
        shutil.rmtree(root, ignore_errors=True)
    return {"name": name, "bytes": size, **{k: statistics.median(v) for k, v in
            (("save", save), ("export", export), ("announce", announce), ("load", load))}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=None, help="default: quick 3, full 5")
    parser.add_argument("--size", choices=list(SIZES), default=None,
                        help="one size only (default: both; the quick profile: the toy one)")
    parser.add_argument("--measured", type=Path, help=argparse.SUPPRESS)  # a --size child's figures, for its parent
    add_flags(parser)
    args = parser.parse_args()
    args.repeats = args.repeats or profile_default(args.profile, 3, 5)
    if args.size is None:  # megatron's global parallel state allows one trainer per process: one process per size
        sizes = profile_default(args.profile, list(SIZES)[:1], list(SIZES))
        figures = []
        with tempfile.TemporaryDirectory() as tmp:
            for name in sizes:
                measured = Path(tmp) / "measured.json"
                subprocess.run([sys.executable, __file__, "--size", name, "--repeats", str(args.repeats),
                                "--measured", str(measured)], check=True)
                r = json.loads(measured.read_text())
                figures.append(Figure(f"export + announce ms, {name.split()[0]}", "ms",
                                      (r["export"] + r["announce"]) * 1e3, r["save"] * 1e3, "RLTrainer.save checkpoint",
                                      higher_is_better=False, repeats=args.repeats))
        write_results(args.results, "bench_policy_export", args.profile, figures, sizes=sizes)
        return
    r = measure(args.size, SIZES[args.size], args.repeats)
    if args.measured:
        args.measured.write_text(json.dumps(r))
    added = r["export"] + r["announce"]
    print(
        f"{r['name']}: weights {r['bytes'] / 2**20:.2f} MiB | checkpoint save (anchor) {r['save'] * 1e3:.1f} ms | "
        f"export {r['export'] * 1e3:.1f} ms + announce {r['announce'] * 1e3:.1f} ms = {added * 1e3:.1f} ms "
        f"({added / r['save']:.2f}x the save) | sampler load + verify {r['load'] * 1e3:.1f} ms",
        flush=True,
    )


if __name__ == "__main__":
    main()
