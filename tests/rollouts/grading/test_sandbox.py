"""Hostile completions against the real bubblewrap sandbox (nothing mocked). Each hostile program is written so
that, were the attack to work, its task's test would pass: a sandbox that leaked would turn the verdict green."""

from __future__ import annotations

import os
import socket
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from ember.rollouts.grading.base import Task, Verdict
from ember.rollouts.grading.sandbox import Sandbox, SandboxLimits
from ember.rollouts.grading.unit_tests import UnitTestGrader

REPO = Path(__file__).resolve().parents[3]
LIMITS = SandboxLimits(wall_s=4, cpu_s=2, memory_mb=512, processes=16, file_size_mb=8, output_bytes=1 << 20, tmp_mb=16)
SLACK_S = 15.0  # a generous bound over the wall limit: a loaded 2-core machine must not flake it


def task(expected: object, args: str = "") -> Task:
    """A one-test task: check(candidate) asserts candidate(args) == expected."""
    return Task("hostile", 'def f(*args):\n    """Answer."""\n', f"def check(candidate):\n    assert candidate({args}) == {expected!r}\n", "f")


def body(code: str) -> str:
    """A completion that continues `def f(*args):` with `code` as its body."""
    return textwrap.indent(textwrap.dedent(code).strip() + "\n", "    ")


def fenced(code: str) -> str:
    """A completion answering with a full program in a ```python block."""
    return f"Here you go:\n```python\n{textwrap.dedent(code).strip()}\n```\n"


@pytest.fixture(scope="module")
def grader():
    with UnitTestGrader("unit_tests", "test", LIMITS, workers=2) as grader:
        yield grader


def grade_timed(grader: UnitTestGrader, task: Task, completion: str):
    start = time.monotonic()
    grade = grader.grade_batch([(task, completion)])[0]
    elapsed = time.monotonic() - start
    assert elapsed < LIMITS.wall_s + SLACK_S, f"{grade} took {elapsed:.1f} s"
    return grade


def test_an_honest_completion_passes_and_a_wrong_one_fails(grader):
    right, wrong = grader.grade_batch([(task(3, "1, 2"), body("return args[0] + args[1]")),
                                       (task(3, "1, 2"), body("return args[0] - args[1]"))])
    assert (right.verdict, right.score, right.components) == (Verdict.PASSED, 1.0, {"tests_passed": 1.0})
    assert (wrong.verdict, wrong.score, wrong.components) == (Verdict.FAILED, 0.0, {"tests_passed": 0.0})


HOSTILE = {
    "infinite loop": (task(1), body("while True:\n    pass"), {Verdict.TIMEOUT}),
    "fork bomb": (task(1), body("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """), {Verdict.TIMEOUT}),
    "10 GB allocation": (task(10 << 30), body("return len(bytearray(10 << 30))"), {Verdict.MEMORY}),
    "10 GB allocation while loading": (task(1), fenced("""
        hoard = bytearray(10 << 30)
        def f(*args):
            return 1
    """), {Verdict.MEMORY}),
    "10 GB written to disk": (task("written"), body("""
        chunk = b"x" * (1 << 20)
        with open("/tmp/big", "wb") as out:
            for _ in range(10 << 10):
                out.write(chunk)
        return "written"
    """), {Verdict.OUTPUT_LIMIT}),
    "10 GB written to many files": (task("written"), body("""
        chunk = b"x" * (1 << 20)
        for i in range(10 << 10):
            with open(f"/tmp/part{i}", "wb") as out:
                out.write(chunk)
        return "written"
    """), {Verdict.OUTPUT_LIMIT}),
    "100 MB printed": (task(1), body("""
        import sys
        for _ in range(100):
            sys.stdout.write("x" * (1 << 20))
        return 1
    """), {Verdict.OUTPUT_LIMIT}),
    # The harness is the pid namespace's init: SIGKILL from inside the namespace does not reach it, so the wrong
    # answer is still graded (were the harness killed, the verdict would be crashed: never passed).
    "kill -9 of its parent": (task(1), body("""
        import os, signal, time
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(0.2)
        return 2
    """), {Verdict.FAILED}),
    "sys.exit(0) before the tests": (task(1), fenced("import sys\nsys.exit(0)\ndef f(*args):\n    return 1"),
                                     {Verdict.CRASHED}),
    "sys.exit(0) in the call": (task(1), body("import sys\nsys.exit(0)"), {Verdict.FAILED}),
    "os._exit(0) before the tests": (task(1), fenced("import os\nos._exit(0)\ndef f(*args):\n    return 1"),
                                     {Verdict.CRASHED}),
    "os._exit(0) in the call": (task(1), body("import os\nos._exit(0)"), {Verdict.CRASHED}),
    "monkeypatching the harness": (task(1), fenced("""
        import sys
        harness = sys.modules["__main__"]
        harness.Harness.record = lambda self, ok: None
        harness.run = lambda h, job: ("passed", "")
        harness.main = lambda: None
        for fd in range(3, 64):
            try:
                import os
                os.write(fd, b'{"outcome": "passed", "total": 1, "passed": 1, "detail": ""}\\n')
            except OSError:
                pass
        def f(*args):
            return 2
    """), {Verdict.CRASHED, Verdict.FAILED}),
    "an object equal to everything": (task([1, 2]), fenced("""
        class Anything:
            def __eq__(self, other):
                return True
        def f(*args):
            return Anything()
    """), {Verdict.FAILED}),
    "ptrace of the harness": (task(0), body("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.ptrace(16, os.getppid(), 0, 0)
    """), {Verdict.FAILED}),
    "a process that ignores SIGTERM": (task(1), body("""
        import os, signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.fork() == 0:
            while True:
                pass
        while True:
            pass
    """), {Verdict.TIMEOUT}),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_each_hostile_completion_gets_its_named_verdict_within_its_limit(grader, case):
    task_, completion, verdicts = HOSTILE[case]
    grade = grade_timed(grader, task_, completion)
    assert grade.verdict in verdicts, grade
    assert grade.score == 0.0


def test_the_broker_is_unreachable(grader, kafka):
    host, port = kafka.split(",")[0].rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=5).close()  # reachable from the grader itself
    completion = body(f"""
        import socket
        socket.create_connection(({host!r}, {int(port)}), timeout=1).close()
        return "connected"
    """)
    grade = grade_timed(grader, task("connected"), completion)
    assert grade.verdict is Verdict.FAILED, grade


def test_the_graders_files_and_secrets_are_not_visible(grader, tmp_path):
    secret = tmp_path / "grader.password"
    secret.write_text("hunter2\n")
    ember_home = Path(os.environ.get("EMBER_HOME", REPO / ".ember"))
    paths = [secret, REPO / "pyproject.toml", REPO / "ember" / "configs.py", Path(psutil.__file__)]
    paths += sorted((ember_home / "kafka-secure" / "credentials").glob("*.password"))[:2]
    read = body("return open(args[0], 'rb').read()")
    grades = grader.grade_batch([(task(path.read_bytes(), repr(str(path))), read) for path in paths])
    assert [grade.verdict for grade in grades] == [Verdict.FAILED] * len(paths), grades
    visible = grade_timed(grader, task(["dev", "lib", "lib64", "root", "tmp", "usr"]),
                          body("import os\nreturn sorted(os.listdir('/'))"))
    assert visible.verdict is Verdict.PASSED, visible  # the whole root: no /work, /etc, /proc, /home


def _children() -> set[int]:
    """This process's descendants: a test that shares its worker with a session fixture's server (the judge's) must
    find nothing new, not nothing at all."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_a_daemon_does_not_outlive_its_run(grader):
    completion = body("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(600)
            os._exit(0)
        return 1
    """)
    before = _children()
    grade = grade_timed(grader, task(1), completion)
    assert grade.verdict is Verdict.PASSED, grade  # its answer is right; the daemon is what must not survive
    assert _children() <= before
    assert not any("time.sleep(600)" in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))


RUNS = int(os.environ.get("EMBER_SANDBOX_LEAK_RUNS", "1000"))
HOSTILE_MIX = ["kill -9 of its parent", "os._exit(0) before the tests", "sys.exit(0) in the call",
               "10 GB allocation", "100 MB printed", "10 GB written to disk", "monkeypatching the harness",
               "ptrace of the harness", "an object equal to everything"]


def test_a_thousand_hostile_runs_leak_nothing(tmp_path, monkeypatch):
    """1,000 runs in one grader process: no process, fd, temp file or cgroup left behind. Quick hostile programs
    make up most of the mix, with a fork bomb and a loop every 25th run, each held by a 1 s wall limit."""
    limits = SandboxLimits(wall_s=1, cpu_s=1, memory_mb=256, processes=8, file_size_mb=1, output_bytes=1 << 16,
                           tmp_mb=4)
    cases = [HOSTILE[name] for name in HOSTILE_MIX] + [(task(1), body("return 1"), {Verdict.PASSED})]
    items, expected = [], []
    for i in range(RUNS):
        task_, completion, verdicts = HOSTILE[("fork bomb", "infinite loop")[i % 2]] if i % 25 == 0 else \
            cases[i % len(cases)]
        items.append((task_, completion))
        expected.append(verdicts)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the shared /tmp has other users' files
    fds_before = sorted(os.listdir("/proc/self/fd"))
    children_before = _children()
    with UnitTestGrader("unit_tests", "leak", limits, workers=4) as grader:
        cgroup = getattr(grader._sandbox._cgroups, "base", None)
        grades = grader.grade_batch(items)
    wrong = [(i, grade) for i, (grade, verdicts) in enumerate(zip(grades, expected)) if grade.verdict not in verdicts]
    assert wrong == [], wrong[:5]
    assert _children() <= children_before
    assert sorted(os.listdir("/proc/self/fd")) == fds_before
    assert os.listdir(tmp_path) == []
    assert cgroup is None or not cgroup.exists()


def test_a_harness_that_never_starts_is_told_apart_from_one_killed_later():
    sandbox = Sandbox(LIMITS, slots=1)
    try:
        silent = sandbox.run("raise SystemExit(3)", b"")
        killed = sandbox.run("import os, sys\nos.write(int(sys.argv[1]), b'started\\n')\nos.abort()", b"")
    finally:
        sandbox.close()
    assert (silent.started, silent.report, silent.returncode) == (False, None, 3)
    assert (killed.started, killed.report) == (True, None)
    assert killed.returncode != 0


def test_the_wall_clock_runs_from_the_harness_start_not_the_interpreter_start():
    """A loaded grader host can take seconds to start an interpreter; that is not the completion's time. Here the
    harness spends 1.5 s before "started" (as a slow start would) and then finishes at once, under a 0.5 s wall
    clock: it is not a timeout. Spending the same time after "started" is."""
    sandbox = Sandbox(SandboxLimits(wall_s=0.5, cpu_s=5), slots=1)
    slow_start = "import os, sys, time\ntime.sleep(1.5)\nr = int(sys.argv[1])\nos.write(r, b'started\\n')\nos.write(r, b'{}\\n')"
    slow_run = "import os, sys, time\nr = int(sys.argv[1])\nos.write(r, b'started\\n')\ntime.sleep(1.5)\nos.write(r, b'{}\\n')"
    try:
        started_late, ran_late = sandbox.run(slow_start, b""), sandbox.run(slow_run, b"")
    finally:
        sandbox.close()
    assert (started_late.started, started_late.timed_out, started_late.report) == (True, False, "{}"), started_late
    assert (ran_late.started, ran_late.timed_out, ran_late.report) == (True, True, None), ran_late
