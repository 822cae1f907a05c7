"""Where a local Beam job's logs go: always into a log file, to the terminal only with `--verbose`.

Beam, absl and grpc log at INFO/WARNING in the driver and in every SDK worker process (the
FnApiRunner's multi-process workers are `sdk_worker_main` subprocesses that log to the stderr they
inherit). None of it is the operator's business unless something breaks, so for the duration of a
job file descriptor 2 - the driver's and, by inheritance, the job process's and the workers' - is a
pipe that a thread copies into the log file (and, when verbose, on to the terminal's stderr); the
driver's and the job process's Python logging write to the same descriptor at INFO. The terminal keeps stdout: progress, the summary, warnings and errors.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DRAIN_SECONDS = 5.0
"""How long the copy thread may take to drain the pipe after the job (a stray worker keeping the pipe
open is left behind rather than holding up the exit)."""


def log_path_for(output: str) -> Path:
    """`<output>.log` beside a local output directory (outside it: the output is staged and swapped
    whole, and holds only ember's own files); for a URL output, a private local file that `publish_log` copies
    beside the output when the job ends (the current directory is not the job's)."""
    if "://" in output:
        folder = Path(tempfile.mkdtemp(prefix="ember-log-"))
        return folder / f"{output.rstrip('/').rsplit('/', 1)[-1] or 'output'}.log"
    target = Path(os.path.abspath(output))
    return target.with_name(target.name + ".log")


def url_log_for(output: str) -> str | None:
    """Where the log of a job writing to URL `output` ends up: `<output>.log` beside it; None for a local output."""
    return f"{output.rstrip('/')}.log" if "://" in output else None


def publish_log(log: JobLog, output: str) -> str | None:
    """Copy a finished job's local log to `url_log_for(output)` and remove the local copy; the URL, or None when
    `output` is local, or the local path when the copy failed (so the operator still has the log)."""
    target = url_log_for(output)
    if target is None or log.path is None:
        return None
    from ember import storage

    try:
        storage.preflight(target)  # a bucket that is not there fails at once, not after an upload's retries
        storage.upload(log.path, target)
    except Exception as exc:  # noqa: BLE001 - a store that refuses the log must not hide the job's own outcome
        logging.getLogger(__name__).warning("the log stays at %s: copying it to %s failed (%s)", log.path, target, exc)
        return str(log.path)
    log.path.unlink(missing_ok=True)
    if log.path.parent.name.startswith("ember-log-"):
        log.path.parent.rmdir()
    return target


class JobLog:
    """The copy of fd 2 into the log file; lines that come before the file is named wait in memory."""

    def __init__(self, read_fd: int, echo_fd: int | None):
        self._read_fd, self._echo_fd = read_fd, echo_fd
        self._lock = threading.Lock()
        self._pending: list[bytes] = []
        self._file = None
        self.path: Path | None = None
        self._thread = threading.Thread(target=self._copy, name="job-logs", daemon=True)
        self._thread.start()

    def write_to(self, path: Path) -> Path:
        """Name the log file (created or truncated); what was logged so far goes in first. Where `path`
        cannot be written (the output's own checks say why, next) the log goes to the temp directory."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            log = open(path, "wb")
        except OSError:
            path = Path(tempfile.gettempdir()) / path.name
            log = open(path, "wb")
        with self._lock:
            self._file = log
            self._file.write(b"".join(self._pending))
            self._file.flush()
            self._pending.clear()
            self.path = path
        return path

    def _copy(self) -> None:
        while chunk := os.read(self._read_fd, 65536):
            with self._lock:
                if self._file is None:
                    self._pending.append(chunk)
                else:
                    self._file.write(chunk)
                    self._file.flush()
            if self._echo_fd is not None:
                os.write(self._echo_fd, chunk)

    def finish(self) -> bool:
        """Wait for the pipe to drain; False when a stray worker still holds it open."""
        self._thread.join(DRAIN_SECONDS)
        if self._thread.is_alive():
            return False
        os.close(self._read_fd)
        if self._file is not None:
            self._file.close()
        return True


class _OwnOrSevere(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith("ember") or record.levelno >= logging.ERROR


@contextmanager
def quiet_third_party() -> Iterator[None]:
    """For commands that run no job (report, inspect, export): ember's own warnings and anyone's errors
    reach stderr, third-party INFO/WARNING do not, nor Python warnings (megatron's and Transformer Engine's
    import-time UserWarnings; ember issues none): they become `py.warnings` log records, filtered alike.
    A root handler also keeps `logging.warning` from installing its own."""
    root = logging.getLogger()
    handler = logging.StreamHandler()
    handler.addFilter(_OwnOrSevere())
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    saved = root.handlers[:]
    root.handlers = [handler]
    with warnings.catch_warnings():  # restores warnings.showwarning, whatever captureWarnings leaves
        logging.captureWarnings(True)
        try:
            yield
        finally:
            logging.captureWarnings(False)
            root.handlers = saved


_active = False
"""Whether a `job_logs` block is running: the root logger then writes to its log file."""


def log_outcome(message: str) -> None:
    """Put the line a command ends with (its error, or why it stopped) into the job's log file too, so a job that
    fails before any worker logs leaves a log that says why rather than an empty one; outside a job, nothing."""
    if _active:
        logging.getLogger("ember.cli").error("%s", message)


@contextmanager
def job_logs(verbose: bool = False) -> Iterator[JobLog]:
    """Send every log of the job (driver and worker processes) to the log file the caller names with
    `JobLog.write_to` (and to stderr when `verbose`); nothing is lost before it is named."""
    root = logging.getLogger()
    saved_level, saved_handlers = root.level, root.handlers[:]
    saved_stderr = os.dup(2)
    read_fd, write_fd = os.pipe()
    log = JobLog(read_fd, saved_stderr if verbose else None)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    stream = open(2, "w", closefd=False, buffering=1)  # fd 2 itself, whatever sys.stderr is
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    global _active
    _active = True
    try:
        yield log
    finally:
        _active = False
        stream.flush()
        root.handlers, root.level = saved_handlers, saved_level
        os.dup2(saved_stderr, 2)  # the driver's last reference to the pipe's write end: EOF once workers are gone
        if log.finish():
            os.close(saved_stderr)


@contextmanager
def logs_for(output: str, verbose: bool, say: Callable[[str], None]) -> Iterator[JobLog]:
    """`job_logs` named for a job writing to `output` and announced with `say`; for a URL output the log is copied
    beside it (`publish_log`) once the job has ended, however it ended."""
    target = url_log_for(output)
    log: JobLog | None = None
    try:
        with job_logs(verbose) as log:
            path = log.write_to(log_path_for(output))
            say(f"log: {path}" + (f" (copied to {target} when the job ends)" if target else ""))
            yield log
    finally:
        if target is not None and log is not None:
            publish_log(log, output)
