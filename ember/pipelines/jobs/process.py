"""SIGINT/SIGTERM stop a build or tokenize job within seconds, every worker process with it.

Beam's FnApiRunner in multi-processing mode does not survive a Ctrl-C: the terminal's SIGINT kills its
SDK workers, and the driver then waits forever for results they will never send. So while
`stop_on_signals()` is active (the `ember corpus build` and `tokenize` commands), each Beam job runs in a
child process in a session of its own - the terminal's signal reaches only ember's own process - and a
signal raises `Interrupted` in the main thread: the child's whole process group (the SDK workers) is
terminated, then killed after `GRACE_SECONDS`, and every descendant is waited for before the exception
travels on, through the staging clean-up, to the command's one-line "interrupted: ..." and exit code
128 + signal (130 for SIGINT, 143 for SIGTERM). Without it (library use, tests, the Dataflow template),
jobs run in this process as before. One job process serves every job of the block in turn (a build's
phases, then its tokenize job): Beam and ember are imported once per command, not once per job, which on
a small build is seconds of a run that takes tens of them.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

GRACE_SECONDS = 5.0
POLL_SECONDS = 0.2
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A stop signal arrived; like KeyboardInterrupt it passes `except Exception` clean-up untouched.
    `where` and `state` are filled in on the way out, for the one-line message."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum
        self.where = ""
        self.state = ""

    def __str__(self) -> str:
        where = f" during {self.where}" if self.where else ""
        return f"{signal.Signals(self.signum).name}{where}" + (f"; {self.state}" if self.state else "")


class JobProcessFailed(RuntimeError):
    """The job's process ended without a result (killed from outside, or out of memory)."""


_active = False
_server: subprocess.Popen | None = None
_deferring = 0
_pending: int | None = None


def _on_signal(signum: int, _frame: Any) -> None:
    global _pending
    if _deferring:
        _pending = _pending or signum
        return
    raise Interrupted(signum)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` in the main thread, and Beam jobs run isolated, inside the block."""
    global _active
    previous = {s: signal.signal(s, _on_signal) for s in SIGNALS}
    _active = True
    try:
        yield
    finally:
        _active = False
        try:
            _close_server()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """A step that must not stop half way (swapping an output in, publishing a cache entry) finishes first;
    a signal that arrived meanwhile is raised right after it."""
    global _deferring, _pending
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        if not _deferring and _pending is not None:
            signum, _pending = _pending, None
            raise Interrupted(signum)


def isolating() -> bool:
    return _active


def run_job(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`: in the job process (a child in a session of its own, started on first use) while
    `stop_on_signals()` is active, else here. `fn` and `args` must pickle (a module-level function, configs,
    plain lists)."""
    global _server
    if not _active:
        return fn(*args)
    if _server is None or _server.poll() is not None:
        root = str(Path(__file__).resolve().parents[3])  # the child imports this same ember, not an installed one
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        _server = subprocess.Popen([sys.executable, "-m", __name__], env=env, start_new_session=True,
                                   stdin=subprocess.PIPE, text=True)
    child = _server
    with tempfile.TemporaryDirectory(prefix="ember-job-") as tmp:
        call, result = Path(tmp) / "call.pickle", Path(tmp) / "result.pickle"
        call.write_bytes(pickle.dumps((fn, args)))
        try:
            child.stdin.write(f"{call}\t{result}\n")
            child.stdin.flush()
            while not result.exists() and child.poll() is None:
                time.sleep(POLL_SECONDS)
        except BaseException:
            stop_tree(child)
            raise
        if not result.exists():
            raise JobProcessFailed(f"the job process ended with exit code {child.returncode} and no result")
        ok, value = pickle.loads(result.read_bytes())
    if ok:
        return value
    raise value


def _close_server() -> None:
    """The job process ends when its input does; one that does not within `GRACE_SECONDS` is stopped."""
    global _server
    child, _server = _server, None
    if child is None or child.poll() is not None:
        return
    try:
        child.stdin.close()
        child.wait(timeout=GRACE_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        stop_tree(child)


def stop_tree(child: subprocess.Popen) -> None:
    """Terminate the child's process group and every descendant, kill what outlives `GRACE_SECONDS`, reap them."""
    try:
        tree = [psutil.Process(child.pid), *psutil.Process(child.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    with signals_deferred():
        for sig, wait in ((signal.SIGTERM, GRACE_SECONDS), (signal.SIGKILL, GRACE_SECONDS)):
            try:
                os.killpg(child.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            for process in tree:
                try:
                    process.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            _, tree = psutil.wait_procs(tree, timeout=wait)
            if not tree:
                break
        child.wait()


def _portable(exc: BaseException) -> BaseException:
    """The job's exception as the parent will raise it, with the child's traceback as a note."""
    note = "in the job process:\n" + "".join(traceback.format_exception(exc)).rstrip()
    try:
        copy = pickle.loads(pickle.dumps(exc))
    except Exception:
        copy = RuntimeError(f"{type(exc).__name__}: {exc}")
    copy.add_note(note)
    return copy


def _serve() -> None:
    """The job process: one `call<TAB>result` pair of paths a line on stdin, each run in turn, until stdin ends."""
    from ember.pipelines.jobs.logs import LOG_FORMAT

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)  # to the inherited fd 2: the parent's job log
    for line in sys.stdin:
        _main(*line.rstrip("\n").split("\t"))


def _main(call: str, result: str) -> None:
    fn, args = pickle.loads(Path(call).read_bytes())
    try:
        outcome = (True, fn(*args))
    except Exception as exc:
        outcome = (False, _portable(exc))
    tmp = Path(result).with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(outcome))
    os.replace(tmp, result)


if __name__ == "__main__":
    _serve()
