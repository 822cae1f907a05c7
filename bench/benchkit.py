"""What every benchmark shares with `make bench`: a size profile and one JSON shape for its headline figures.

`make bench` runs each benchmark as `bench/bench_x.py --profile quick|full --results FILE` and gathers the files
into bench/results.json, so each benchmark owns its sizes per profile and names its own headline figures. A
figure compares ember with its anchor measured in the same run; `ratio` is always "ember over anchor, > 1 means
ember is better", whichever way the unit points.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

PROFILES = ("quick", "full")
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Figure:
    """One headline number: ember's median, its anchor's median from the same run, and which way is better.

    `target` is the goal the issue names for `ratio` (0.9 means "ember at least 0.9x its anchor"), not a raw value."""

    metric: str
    unit: str
    ember: float
    anchor: float | None = None
    anchor_name: str | None = None
    higher_is_better: bool = True
    repeats: int = 1
    target: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.anchor is None or not self.anchor or not self.ember:
            return None
        return self.ember / self.anchor if self.higher_is_better else self.anchor / self.ember


def add_flags(parser: argparse.ArgumentParser) -> None:
    """`--profile` picks the benchmark's sizes (None: its own defaults); `--results` writes its figures as JSON."""
    parser.add_argument("--profile", choices=PROFILES, default=None,
                        help="quick: minutes, for `make bench`; full: the sizes BENCHMARKS.md quotes")
    parser.add_argument("--results", type=Path, default=None, help="write the headline figures as JSON to this file")


def profile_default(profile: str | None, quick, full, default=None):
    """The value of one size for the chosen profile; without a profile, the benchmark's own default."""
    if profile is None:
        return full if default is None else default
    return quick if profile == "quick" else full


def machine() -> dict:
    """Where the figures came from: cores, the load average when written, and the commit measured."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                    capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    return {"commit": commit, "dirty": dirty, "cores": os.cpu_count(), "loadavg": list(os.getloadavg()),
            "python": platform.python_version()}


def write_results(path: Path | None, bench: str, profile: str | None, figures: list[Figure], **details) -> None:
    """Write one benchmark's figures (and any sizes or settings worth keeping) where `--results` said."""
    if path is None:
        return
    rows = [{**asdict(f), "ratio": f.ratio} for f in figures]
    payload = {"bench": bench, "profile": profile, "machine": machine(), "figures": rows, "details": details}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
