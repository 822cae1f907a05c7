"""What publishing a policy version costs, full against delta: bytes and seconds per version for export + upload
(`VersionPublisher.publish`) and the sampler's load (`load_policy`, following every version, so a delta is rebuilt
on the version in use), to local disk and to the local S3 server (moto, infra/objectstores.sh).

The versions are real consecutive torch.distributed checkpoints in megatron's layout (not trainer steps: a CPU
trainer step costs more than everything measured here), each an Adam-like step from the last: every weight moved
by +-lr (1e-5 by default; RL runs train at 1e-6 to 1e-5). Full: every version a full export. Delta:
full_every_k 4, so versions 1 and 5 are full and 2-4 deltas; the delta rows are the median over the delta
versions, "per version" the mean over all five (what a run pays on average). Medians of 3 repeats, the four
paths taking turns; CPU only, timing never decides pass/fail.

    EMBER_HOME=/work/main/.ember .venv/bin/python bench/bench_publish.py [--repeats 3] [--lr 1e-5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402

VERSIONS, K = 5, 4
SIZES = {
    "tiny RL example (2 layers, h64, 4 experts)": {},
    "small (4 layers, h256, 8 experts, ffn 512)": {"num_layers": 4, "hidden_size": 256, "num_experts": 8, "ffn_hidden_size": 512},
}


def _shape(sizes: dict):
    from tests.inference.support import example_shape

    model, moe = example_shape()
    return (
        model.model_copy(update={k: v for k, v in sizes.items() if k in ("num_layers", "hidden_size")}),
        moe.model_copy(update={k: v for k, v in sizes.items() if k in ("num_experts", "ffn_hidden_size")}),
    )


def _round(checkpoints: list[Path], model, moe, root: Path, uri: str | None, k: int) -> list[dict]:
    """One pass over the versions: published (export + upload), then loaded by a sampler following them."""
    from ember.inference.policy import load_policy
    from ember.midtrain.rl.publish import VersionPublisher

    publisher = VersionPublisher(root, model, moe, publish_uri=uri, full_every_k=k, keep_versions=VERSIONS)
    rows, loaded = [], None
    for version, checkpoint in enumerate(checkpoints, 1):
        t0 = time.perf_counter()
        done = publisher.publish(checkpoint, version, version)
        t1 = time.perf_counter()
        loaded = load_policy(done.uri, done.sha256, version, known=loaded)
        t2 = time.perf_counter()
        assert loaded.sha256 == done.sha256
        rows.append({"delta": done.delta, "bytes": done.bytes, "publish": t1 - t0, "load": t2 - t1})
    return rows


def measure(sizes: dict, bucket: str, repeats: int, lr: float) -> dict:
    from tests.inference.support import consecutive_checkpoints

    model, moe = _shape(sizes)
    work = Path(tempfile.mkdtemp(prefix="bench-publish-"))
    checkpoints = consecutive_checkpoints(work / "checkpoints", VERSIONS, lr=lr, model=model, moe=moe)
    runs: dict[tuple[str, str], list[list[dict]]] = {}
    for repeat in range(repeats + 1):  # the first warms up; the four paths take turns, so load drift hits all alike
        for target in ("local disk", "S3 (moto)"):
            for mode, k in (("full", 1), ("delta", K)):
                tag = f"{target[:2]}-{mode}-{repeat}-{uuid.uuid4().hex[:6]}"
                rows = _round(checkpoints, model, moe, work / tag, None if target == "local disk" else f"{bucket}/{tag}", k)
                if repeat:
                    runs.setdefault((target, mode), []).append(rows)
    results = {}
    for (target, mode), per_repeat in runs.items():
        picked = [[r for r in rows if r["delta"] == (mode == "delta")] for rows in per_repeat]
        results[(target, mode)] = {
            key: statistics.median(statistics.median(r[key] for r in rows) for rows in picked)
            for key in ("bytes", "publish", "load")
        } | {"mean_bytes": statistics.median(statistics.mean(r["bytes"] for r in rows) for rows in per_repeat),
             "mean_s": statistics.median(statistics.mean(r["publish"] + r["load"] for r in rows) for rows in per_repeat)}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-5)
    add_flags(parser)
    args = parser.parse_args()
    sizes = profile_default(args.profile, dict(list(SIZES.items())[:1]), SIZES)  # quick: the tiny policy only
    import boto3

    from ember.dev import services

    os.environ.update(services.objectstores_env())
    bucket = f"ember-bench-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    print(f"lr {args.lr:g}, {VERSIONS} versions, delta full_every_k {K}, medians of {args.repeats}\n")
    print("| policy | target | mode | bytes/version | export+upload s | sampler load s | total s | per version (mean of 5): bytes, s |")
    print("|---|---|---|---|---|---|---|---|")
    figures = []
    for name, shape in sizes.items():
        measured = measure(shape, f"s3://{bucket}", args.repeats, args.lr)
        for (target, mode), r in measured.items():
            print(f"| {name} | {target} | {mode} | {r['bytes']:,.0f} | {r['publish']:.3f} | {r['load']:.3f} | "
                  f"{r['publish'] + r['load']:.3f} | {r['mean_bytes']:,.0f}, {r['mean_s']:.3f} |", flush=True)
        full, delta = measured[("S3 (moto)", "full")], measured[("S3 (moto)", "delta")]
        short = name.split(" (")[0]
        figures += [Figure(f"S3 s per version (mean of {VERSIONS}), {short}", "s", delta["mean_s"], full["mean_s"],
                           "full export every version", higher_is_better=False, repeats=args.repeats),
                    Figure(f"S3 bytes per version (mean of {VERSIONS}), {short}", "bytes", delta["mean_bytes"],
                           full["mean_bytes"], "full export every version", higher_is_better=False, repeats=args.repeats)]
    write_results(args.results, "bench_publish", args.profile, figures, lr=args.lr, sizes=list(sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
