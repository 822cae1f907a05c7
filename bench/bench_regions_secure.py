"""Rollouts through the secured mirror (`ember dev up --regions us --secure`) vs produced to the secured central.

The secured counterpart of bench_regions.py's "mirror alone" breakdown, in one run: ember's path is a rollout produced
as ember-inference to region us's SASL_SSL cluster and copied by MirrorMaker 2 (exactly-once, as ember-mirror, over
SASL_SSL) into kafka-secure as `us.<prefix>.rollouts`; the anchor is the same rollout produced as ember-inference
straight to kafka-secure. A read_committed reader (the admin) on kafka-secure times both. Every link is TLS +
SCRAM-SHA-512, so set against bench_regions.py's plaintext figures the ratios say what securing the mirror costs.

- throughput: --rollouts rollouts of --bytes each sent as fast as acknowledged; rollouts/s first send -> last read.
- latency at a steady --rate rollouts/s for --seconds: p50/p99 of read in central - sent; the p50 difference is the
  replication lag through the secured mirror at that rate.

All clusters (kafka-secure, the secured regions, MM2) and this process share one machine: not a WAN figure.

    .venv/bin/python bench/bench_regions_secure.py --profile quick|full [--results FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_regions import run_path  # noqa: E402
from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.dev import services  # noqa: E402
from ember.rollouts.acls import region_bindings, role_bindings  # noqa: E402
from ember.rollouts.admin import apply_acls, ensure_topics  # noqa: E402
from ember.rollouts.security import role_securities  # noqa: E402
from ember.rollouts.topics import Topics  # noqa: E402

REGIONS = ["us"]  # the secured test's set: one region
PREFIX = "regsec-"  # tests/rollouts/test_regions_secure.py's prefix family: the same MM2 config, no MM2 restart


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(parser)
    parser.add_argument("--rollouts", type=int, default=None, help="rollouts in the burst")
    parser.add_argument("--bytes", type=int, default=16384, help="bytes per rollout")
    parser.add_argument("--rate", type=float, default=None, help="steady rollouts/s")
    parser.add_argument("--seconds", type=float, default=None, help="the steady phase's length")
    args = parser.parse_args()
    rollouts = args.rollouts or profile_default(args.profile, 300, 2000)
    rate = args.rate or profile_default(args.profile, 50.0, 100.0)
    seconds = args.seconds or profile_default(args.profile, 8.0, 30.0)
    os.environ.setdefault("EMBER_MM2_OUT_TOPICS", PREFIX + r".*\.policy-versions")
    services.start("kafka-secure")
    services.start_regions(REGIONS, secure=True)
    broker = services.secure_broker()
    central, region = broker.bootstrap, services.region_bootstrap("us", secure=True)
    roles = role_securities(broker)
    admin, inference = roles["admin"].client_kwargs(), roles["inference"].client_kwargs()
    print(f"all clusters (kafka-secure, secured {', '.join(REGIONS)}, MM2) and this process share one machine "
          f"({os.cpu_count()} cores), load {os.getloadavg()[0]:.1f}")

    tag = uuid.uuid4().hex[:8]
    results = {}
    for phase, count, pace in (("burst", rollouts, None), ("steady", int(rate * seconds), rate)):
        mirror, direct = Topics(f"{PREFIX}bench-{tag}-{phase}"), Topics(f"{PREFIX}bench-direct-{tag}-{phase}")
        ensure_topics(region, [mirror.specs(2)["rollouts"]], roles["admin"])
        ensure_topics(central, [direct.specs(2)["rollouts"]], roles["admin"])
        apply_acls(region, region_bindings(mirror.prefix), roles["admin"])  # inference writes, the mirror reads
        for prefix in (mirror.prefix, direct.prefix):
            apply_acls(central, role_bindings(prefix, regions=["us"]), roles["admin"])
        results[("direct", phase)] = run_path(
            "direct", central, direct.rollouts, direct.rollouts, central, count, args.bytes, pace, inference, admin
        )
        results[("mirror", phase)] = run_path(
            "mirror", region, mirror.rollouts, f"us.{mirror.rollouts}", central, count, args.bytes, pace, inference, admin
        )
    b, d0 = results[("mirror", "burst")], results[("direct", "burst")]
    print(f"secured mirror, {rollouts} x {args.bytes} B burst: {b['rollouts_per_s']:.0f} rollouts/s, direct to kafka-secure "
          f"{d0['rollouts_per_s']:.0f}/s ({b['rollouts_per_s'] / d0['rollouts_per_s']:.2f}x)")
    m, d = results[("mirror", "steady")], results[("direct", "steady")]
    print(f"secured mirror at {rate:g}/s: p50 {m['p50_ms']:.0f} ms p99 {m['p99_ms']:.0f} ms, direct p50 {d['p50_ms']:.0f} ms "
          f"p99 {d['p99_ms']:.0f} ms; replication lag (p50 difference) {m['p50_ms'] - d['p50_ms']:.0f} ms")
    write_results(args.results, "regions_secure", args.profile, [
        Figure("mirror_rollouts_per_s", "rollouts/s", b["rollouts_per_s"], d0["rollouts_per_s"], "direct to kafka-secure"),
        Figure("mirror_latency_p50", "ms", m["p50_ms"], d["p50_ms"], "direct to kafka-secure", higher_is_better=False),
        Figure("mirror_latency_p99", "ms", m["p99_ms"], d["p99_ms"], "direct to kafka-secure", higher_is_better=False),
    ], rollouts=rollouts, rate=rate, seconds=seconds, bytes=args.bytes)


if __name__ == "__main__":
    main()
