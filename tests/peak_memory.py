"""The peak memory of a command, measured so that the test process's own size never counts.

`os.wait4` or RUSAGE_CHILDREN on a child of the test process is not that child's peak: Linux starts a forked (or
vforked) child's high-water mark at the parent's, and exec keeps it, so under pytest-xdist a worker grown to a
gigabyte by earlier tests made a 300 MB build read as 1.3 GB. A small launcher process starts the command
instead and reports its RUSAGE_CHILDREN: the command's peak, and its descendants', from a launcher's few MB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import IO

LAUNCHER = """
import json, resource, subprocess, sys
limits = json.loads(sys.argv[2])
def apply():
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))
code = subprocess.call(sys.argv[3:], preexec_fn=apply if limits else None)
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
sys.exit(code)
"""


def run_with_peak_rss(command: list[str], scratch: Path, *, stdout: IO | int = subprocess.PIPE, limits: dict[str, int] | None = None,
                      **popen) -> tuple[subprocess.CompletedProcess, int]:
    """Run `command` (under `limits`, resource.RLIMIT_* names to values) and return its result and peak RSS in bytes.
    `scratch` is a directory for the launcher's report."""
    report = scratch / "peak-rss.txt"
    done = subprocess.run([sys.executable, "-c", LAUNCHER, str(report), json.dumps(limits or {}), *command],
                          stdout=stdout, stderr=subprocess.STDOUT, **popen)
    return done, int(report.read_text())
