"""`ember demo`: the main job on embedded defaults, end to end on a small real input.

Stages, in the order the system runs them: bring the local services up; check the Kafka wire codec
through the real broker (and that a malformed message is reported, not fatal); build a small mixed
code + web corpus with Beam (filters, redaction, exact + near dedup); tokenize and best-fit pack it
into verified Arrow shards; run a few Megatron-core MoE mid-training steps on those shards; stream
simulated RL rollouts and late rewards through the rollout ETL into training batches that a trainer
reads; run RL steps with router replay on rollouts a reference sampler produced, printing the
trainer/sampler mismatch; close the loop with no simulator (`midtrain rl` on 2 ranks exports and announces each
version, `rollouts sample` hot-swaps it in transformers, `rollouts grade` and `rollouts etl` feed the trainer back);
and run a job on the local Slurm. Each stage contributes rows to one summary table; the demo
fails when a stage raises or a stage's own check (records equal, books balance, shards verify) fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.table import Table

from ember.demo.wire_stage import DEMO_PREFIX, Rows, wire_stage
from ember.dev import services

VERDICTS: dict[str, Callable[[str], bool]] = {
    "records read back equal": lambda v: v.split(" ")[0] == v.split(" ")[2],
    "malformed message reported": lambda v: v.count("@") == 1,
    "corpus accounted (in = kept + rejected)": lambda v: v == "yes",
    "verify": lambda v: v == "OK",
    "books balance": lambda v: v.startswith("yes"),
    "loop": lambda v: int(v.split(" ")[0]) >= 2 and "NO" not in v,
}


def slurm_stage(workdir: Path) -> Rows:
    out = workdir / "slurm-job.out"
    subprocess.run(
        ["sbatch", "--wait", "--job-name=ember-demo", f"--output={out}", "--wrap", "echo ember-demo on $(hostname)"],
        check=True,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return [("slurm job", out.read_text().strip())]


def _healthy(rows: Rows) -> bool:
    return all(check(value) for key, value in rows for name, check in VERDICTS.items() if key == name)


def _write_summary(path: Path, sections: list[tuple[str, float, Rows]], ok: bool) -> None:
    """The summary table as JSON next to the stages' outputs: a reader (or the demo's test) gets each stage's rows
    and seconds without parsing a table that the terminal's width wraps."""
    stages = [{"stage": title, "seconds": round(seconds, 1), "rows": dict(rows)} for title, seconds, rows in sections]
    path.write_text(json.dumps({"ok": ok, "stages": stages}, indent=1) + "\n")


def run_demo(console: Console, *, rollouts: int, group_size: int, tokens: int, layers: int) -> int:
    for service in services.SERVICES:
        with console.status(f"bringing up {service}..."):
            try:
                services.start(service)
            except services.ServiceError as exc:
                if service == "flink":
                    console.print(f"[yellow]flink job server unavailable:[/yellow] {str(exc).splitlines()[-1]}")
                    continue
                console.print(f"[red]{exc}[/red]")
                return 1
    home = Path(os.environ.get("EMBER_HOME", services.REPO_ROOT / ".ember"))
    workdir = home / "demo" / time.strftime("%Y%m%d-%H%M%S")
    workdir.mkdir(parents=True, exist_ok=True)
    console.print(f"demo work directory: {workdir}")

    from ember.demo import midtrain_stage as midtrain_demo
    from ember.demo import rl_stage as rl_demo
    from ember.demo import corpus_stage as corpus_demo
    from ember.demo import etl_stage as rollouts_demo
    from ember.demo import loop_stage as loop_demo

    sections: list[tuple[str, float, Rows]] = []
    context: dict[str, Path] = {}

    def corpus() -> Rows:
        rows, shards_dir = corpus_demo.run(console, workdir)
        context["shards"] = shards_dir
        return rows

    stages: list[tuple[str, Callable[[], Rows]]] = [
        ("wire codec through Kafka", lambda: wire_stage(console, rollouts=rollouts, group_size=group_size, tokens=tokens, layers=layers)),
        ("corpus build: filter, redact, dedup, tokenize, pack (Beam)", corpus),
        ("mid-training (Megatron-core MoE, CPU)", lambda: midtrain_demo.run(console, context["shards"], workdir / "midtrain")),
        ("rollout ETL (Kafka)", lambda: rollouts_demo.run(console, f"{DEMO_PREFIX}-etl-{int(time.time())}", 48, group_size, 512)),
        ("RL steps: sampler -> ETL -> trainer with router replay (Megatron-core MoE, CPU)", lambda: rl_demo.run(console, workdir / "rl")),
        ("RL loop: midtrain rl -> sample (transformers) -> grade -> ETL, no simulator", lambda: loop_demo.run(console, workdir / "loop")),
        ("slurm", lambda: slurm_stage(workdir)),
    ]
    ok = True
    for title, stage in stages:
        console.rule(title)
        started = time.perf_counter()
        try:
            rows = stage()
        except Exception as exc:  # noqa: BLE001 - a failed stage is reported in the summary, then the demo fails
            rows = [("FAILED", f"{type(exc).__name__}: {str(exc)[:500]}")]
            ok = False
        ok = ok and _healthy(rows)
        sections.append((title, time.perf_counter() - started, rows))
        if not ok:
            break
    _write_summary(workdir / "summary.json", sections, ok)

    table = Table("stage", "result", title="ember demo", show_lines=False)
    for title, seconds, rows in sections:
        table.add_row(f"[bold]{title} ({seconds:.0f}s)[/bold]", "")
        for key, value in rows:
            table.add_row(f"  {key}", value)
    console.print(table)
    console.print("[green]demo OK[/green]" if ok else "[red]demo FAILED (see the stage above)[/red]")
    return 0 if ok else 1
