"""What `midtrain status` and `midtrain logs` ask Slurm, with no torch or megatron import.

Why a module of its own: these commands only read job records and log files, and importing the
trainer's data path (torch) took most of `midtrain status`'s 10-17 s on a loaded login node. One
`scontrol show job -o` call returns every job slurmctld knows, so the state of any number of jobs
costs one controller round trip.
"""

from __future__ import annotations

import codecs
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

JOB_NAME_PREFIX = "midtrain-"
# States a job leaves only by being purged. PREEMPTED is final only without requeue (see `job_ended`).
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)


class LaunchError(RuntimeError):
    """Something the user must fix before the job can run or be inspected (the config, an option, a job id);
    the message says what. The CLI exits 2, as for any usage or config error."""


class SlurmFailed(LaunchError):
    """Slurm itself is missing or failed (no sbatch on PATH, sinfo or sbatch erroring): nothing in the request is
    wrong, so the CLI exits 1, as when any service a command needs is down."""


def _scontrol_jobs(job_id: str | None = None) -> str:
    command = ["scontrol", "show", "job", "-o", *([job_id] if job_id else [])]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise SlurmFailed("scontrol is not on PATH: run on a Slurm login node, or `ember dev up --only slurm`") from None
    if result.returncode != 0:
        raise LaunchError(
            f"job {job_id} is not known to slurmctld ({result.stderr.strip()}); finished jobs are forgotten "
            "after MinJobAge: read the logs under the run directory's logs/ instead"
        )
    return result.stdout


def _parse(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", line))


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job` of one job as a dict (no slurmdbd: finished jobs stay visible for MinJobAge)."""
    return _parse(_scontrol_jobs(job_id))


def jobs(job_ids: list[str] | None = None) -> list[dict[str, str]]:
    """The named jobs, or every `midtrain-*` job slurmctld knows, from one `scontrol` call.

    A named job slurmctld does not know is an error naming it (MinJobAge forgets finished jobs)."""
    records = [_parse(line) for line in _scontrol_jobs().splitlines() if "JobId=" in line]
    if not job_ids:
        return [r for r in records if r.get("JobName", "").startswith(JOB_NAME_PREFIX)]
    by_id = {r["JobId"]: r for r in records}
    missing = [j for j in job_ids if j not in by_id]
    if missing:
        raise LaunchError(
            f"job {', '.join(missing)} is not known to slurmctld; finished jobs are forgotten after MinJobAge: "
            "read the logs under the run directory's logs/ instead"
        )
    return [by_id[j] for j in job_ids]


def job_ended(fields: dict[str, str]) -> bool:
    state = fields.get("JobState", "")
    return state in FINAL_STATES or (state == "PREEMPTED" and fields.get("Requeue") == "0")


def job_logs(fields: dict[str, str]) -> list[Path]:
    """The Slurm log and every restart's trainer log of a job, oldest first."""
    slurm_log = Path(fields["StdOut"])
    job_id = fields["JobId"]
    restarts = sorted(
        slurm_log.parent.glob(f"train-{job_id}-*.log"), key=lambda p: int(p.stem.rsplit("-", 1)[1])
    )
    return [slurm_log, *restarts]


_TERMINAL_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f]")


def last_line_with(path: Path, marker: str, tail_bytes: int = 1 << 16) -> str | None:
    """The last finished line of `path` containing `marker`, read from the file's last `tail_bytes` only, as a
    terminal would show it: a line still being written is not one yet (printed, it would run into whatever is
    printed next), and carriage returns and escape sequences are dropped."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, 2) - tail_bytes))
        lines = f.read().decode(errors="replace").split("\n")[:-1]
    shown = (_TERMINAL_CONTROL.sub("", l.rstrip("\r").rsplit("\r", 1)[-1]) for l in reversed(lines))
    return next((l for l in shown if marker in l), None)


def partition_resources(partition: str) -> tuple[int, int, int]:
    """(nodes, GPUs per node, CPUs per node) of a partition, from sinfo; GPUs counted from its gres."""
    result = subprocess.run(
        ["sinfo", "-h", "-p", partition, "-o", "%D|%G|%c"], capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        raise SlurmFailed(f"sinfo failed for partition {partition!r}: {result.stderr.strip()}")
    lines = [l for l in result.stdout.splitlines() if l.strip()]
    if not lines:
        raise LaunchError(f"partition {partition!r} does not exist (sinfo lists none); see `sinfo -s`")
    nodes, gpus, cpus = 0, 0, 0
    for line in lines:
        count, gres, node_cpus = line.split("|", 2)
        nodes += int(count)
        found = [int(m) for m in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres)]
        gpus = max(gpus, max(found) if found else 0)
        cpus = max(cpus, int(node_cpus.rstrip("+")))
    return nodes, gpus, cpus


@dataclass
class _Followed:
    offset: int = 0
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


class LogFollower:
    """`tail -f` over a job's Slurm log and its trainer logs (a requeue adds one), until the job ends.

    Files are polled every `poll_s`, the job's state every `state_every_s` (one scontrol call); once the
    job has ended (or slurmctld forgot it) the files are read to their end one last time.
    """

    def __init__(self, fields: dict[str, str], write: Callable[[str], None], poll_s: float = 0.5, state_every_s: float = 2.0):
        self.fields = fields
        self.write = write
        self.poll_s = poll_s
        self.state_every_s = state_every_s
        self._files: dict[Path, _Followed] = {}
        self._current: Path | None = None
        self._mid_line = False

    def _read_new(self) -> None:
        for path in job_logs(self.fields):
            if not path.exists():
                continue
            followed = self._files.setdefault(path, _Followed())
            with open(path, "rb") as f:
                f.seek(followed.offset)
                data = f.read()
            if not data:
                continue
            followed.offset += len(data)
            if path != self._current:
                self.write(f"{'' if self._current is None else chr(10)}==> {path} <==\n")
                self._current = path
            text = followed.decoder.decode(data)
            if text:
                self.write(text)
                self._mid_line = not text.endswith("\n")

    def _refresh_state(self) -> bool:
        """Whether the job has ended; a job slurmctld no longer knows has ended too."""
        try:
            self.fields = {**self.fields, **job_fields(self.fields["JobId"])}
        except LaunchError:
            return True
        return job_ended(self.fields)

    def follow(self) -> str:
        """Writes what the logs gain until the job ends; returns its final state."""
        next_state = 0.0
        while True:
            self._read_new()
            if time.monotonic() >= next_state:
                if self._refresh_state():
                    self._read_new()
                    if self._mid_line:  # the log's last line has no newline: end it, or the next output joins it
                        self.write("\n")
                    return self.fields.get("JobState", "UNKNOWN")
                next_state = time.monotonic() + self.state_every_s
            time.sleep(self.poll_s)
