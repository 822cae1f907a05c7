"""The unit-test harness that runs inside the sandbox (`python -I -S -c <this file> REPORT_FD`). Standard library only:
the sandbox holds nothing else. Not imported by ember; `unit_tests.py` hands its text to the sandbox.

Why the completion cannot forge its verdict: the harness forks the completion into a child process *before* it
has read the tests, closes the report descriptor in that child, and makes itself non-dumpable so the child can
neither ptrace it nor reach its descriptors. The tests run here, in the harness, against a proxy that asks the
child to call the entry point and accepts only plain data back (`ast.literal_eval`): an object whose `__eq__`
always answers True cannot cross the pipe. Whatever the child does to itself (`sys.exit(0)`, monkeypatching,
a kill -9 of its parent, which as the pid namespace's init ignores it) ends in a named non-passing outcome, and
the exit code is never read as the verdict.

Protocol. stdin: one JSON object {program, entry_point, prompt, tests, limits}. The report descriptor gets
`started` first, then one JSON line {outcome, total, passed, detail}.
"""

import ast
import ctypes
import errno
import json
import os
import resource
import signal
import sys

PR_SET_DUMPABLE = 4
MAX_REPLY = 1 << 20
DISK_FULL = (errno.EFBIG, errno.ENOSPC)


class ChildGone(BaseException):
    """The completion's process is gone or stopped answering; not an Exception, so a test's handler cannot swallow it."""


class CandidateRaised(Exception):
    """The entry point raised, or returned something that is not plain data."""


def _read_line(stream, limit):
    line = stream.readline(limit + 1)
    if not line.endswith(b"\n"):
        return None
    return line


def _child(down_r, up_w):
    """The completion's process: take the program and limits, load it, then answer calls until the pipe closes."""
    os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
    reader = os.fdopen(down_r, "rb")
    writer = os.fdopen(up_w, "wb", buffering=0)

    def reply(tag, value):
        try:
            text = repr((tag, value))
        except BaseException as error:  # a result whose __repr__ raises or recurses
            text = repr(("raise", f"unprintable result: {type(error).__name__}"))
        writer.write(text.encode("utf-8", "backslashreplace") + b"\n")

    job = ast.literal_eval(reader.readline().decode())
    for name, (soft, hard) in job["limits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; a file past RLIMIT_FSIZE should end the run
    namespace = {"__name__": "completion"}
    try:
        exec(compile(job["program"], "completion.py", "exec"), namespace)
        function = namespace[job["entry_point"]]
    except MemoryError:
        reply("load_memory", "MemoryError while loading the program")
        os._exit(0)
    except OSError as error:
        reply("load_disk" if error.errno in DISK_FULL else "load_error", f"{type(error).__name__}: {error}"[:500])
        os._exit(0)
    except BaseException as error:
        reply("load_error", f"{type(error).__name__}: {error}"[:500])
        os._exit(0)
    reply("ready", None)
    for line in reader:
        try:
            result = function(*ast.literal_eval(line.decode()))
        except MemoryError:
            reply("memory", "MemoryError")
            continue
        except OSError as error:
            reply("disk" if error.errno in DISK_FULL else "raise", f"{type(error).__name__}: {error}"[:500])
            continue
        except BaseException as error:
            reply("raise", f"{type(error).__name__}: {error}"[:500])
            continue
        reply("ok", result)
    os._exit(0)


class Harness:
    """Runs the task's `check` in this process, calling the completion in the child through a pipe."""

    def __init__(self, pid, down_w, up_r, cpu_s):
        self.pid = pid
        self.cpu_s = cpu_s
        self.down = os.fdopen(down_w, "wb", buffering=0)
        self.up = os.fdopen(up_r, "rb")
        self.total = 0
        self.passed = 0
        self.memory = False
        self.disk = False

    def receive(self):
        line = _read_line(self.up, MAX_REPLY)
        if line is None:
            raise ChildGone()
        try:
            tag, value = ast.literal_eval(line.decode("utf-8", "replace"))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return "raise", "the entry point returned something that is not plain data"
        return tag, value

    def candidate(self, *args):
        try:
            self.down.write(repr(args).encode() + b"\n")
        except BrokenPipeError:
            raise ChildGone() from None
        tag, value = self.receive()
        if tag == "ok":
            return value
        if tag == "memory":
            self.memory = True
        if tag == "disk":
            self.disk = True
        raise CandidateRaised(value)

    def record(self, ok):
        self.total += 1
        self.passed += bool(ok)

    def child_end(self):
        """Why the child stopped answering: its CPU time, then its wait status, named."""
        _, status, usage = os.wait4(self.pid, 0)
        self.pid = None
        if usage.ru_utime + usage.ru_stime >= self.cpu_s:
            return "timeout", f"the program used its {self.cpu_s} s of CPU"
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            outcome = {signal.SIGXCPU: "timeout", signal.SIGXFSZ: "output_limit", signal.SIGSYS: "forbidden"}
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            return outcome.get(sig, "crashed"), f"the program was killed by {name}"
        return "crashed", f"the program exited with status {os.WEXITSTATUS(status)} before its tests finished"


def _compile_prompt(prompt):
    """The prompt alone, for its imports and helpers; a prompt that stops at `def f(...):` gets a `pass` body."""
    try:
        return compile(prompt, "prompt.py", "exec")
    except SyntaxError:
        return compile(prompt + "    pass\n", "prompt.py", "exec")


def run(harness, job):
    """Send the program, then run the task's instrumented `check` here; returns (outcome, detail)."""
    load = {"program": job["program"], "entry_point": job["entry_point"], "limits": job["limits"]}
    try:
        harness.down.write(repr(load).encode() + b"\n")
        tag, value = harness.receive()
    except (ChildGone, BrokenPipeError):
        return harness.child_end()
    if tag == "load_memory":
        return "memory", value
    if tag == "load_disk":
        return "output_limit", value
    if tag != "ready":
        return "crashed", str(value)
    namespace = {"__name__": "tests", "_ember_record": harness.record}
    try:
        exec(_compile_prompt(job["prompt"]), namespace)
        namespace[job["entry_point"]] = harness.candidate  # tests that name the function mean the completion's
        exec(compile(job["tests"], "tests.py", "exec"), namespace)
        check = namespace["check"]
    except Exception as error:
        return "sandbox_error", f"the task's prompt or tests do not run: {type(error).__name__}: {error}"[:500]
    try:
        check(harness.candidate)
    except ChildGone:
        return harness.child_end()
    except Exception as error:
        return "failed", f"the tests stopped: {type(error).__name__}: {error}"[:500]
    if harness.memory:
        return "memory", "the program ran out of memory during its tests"
    if harness.disk:
        return "output_limit", "the program wrote past its file size limit or filled its /tmp"
    if harness.total and harness.passed == harness.total:
        return "passed", ""
    return "failed", f"{harness.passed}/{harness.total} tests passed"


def main():
    report = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    report.write("started\n")
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    down_r, down_w = os.pipe()
    up_r, up_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            report.close()
            os.close(down_w)
            os.close(up_r)
            _child(down_r, up_w)
        finally:
            os._exit(70)
    os.close(down_r)
    os.close(up_w)
    job = json.loads(sys.stdin.buffer.read())
    harness = Harness(pid, down_w, up_r, job["limits"]["RLIMIT_CPU"][0])
    outcome, detail = run(harness, job)
    report.write(json.dumps({"outcome": outcome, "total": harness.total, "passed": harness.passed,
                             "detail": detail}) + "\n")
    if harness.pid is not None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
