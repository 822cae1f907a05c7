"""`make bench`'s runner on real benchmarks: a real small bench gives a well-formed results.json, a failing one is
recorded with its stderr and turns the runner's exit status non-zero (after the rest still ran)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "bench" / "run_all.py"


def run_all(*args: str, sigint_ignored: bool = False) -> subprocess.CompletedProcess:
    """The runner as a command; `sigint_ignored`: started as a shell starts a background job (`make bench &`)."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    return subprocess.run([sys.executable, str(RUNNER), *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          preexec_fn=ignore)


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_runner_gathers_a_real_bench_into_results_json(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = run_all("--only", "codec", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["profile"] == "quick" and report["commit"] and report["cores"] >= 1
    assert len(report["loadavg"]) == 3 and report["wall_s"] > 0
    (bench,) = report["benches"]
    assert bench["bench"] == "bench_codec" and bench["status"] == "ok" and bench["exit_status"] == 0
    assert len(bench["loadavg_before"]) == 3 and len(bench["loadavg_after"]) == 3 and bench["wall_s"] > 0
    assert bench["figures"], "bench_codec names its headline figures"
    for figure in bench["figures"]:
        assert figure["anchor_name"] and figure["ember"] > 0 and figure["anchor"] > 0 and figure["repeats"] >= 3
        assert figure["ratio"] == figure["ember"] / figure["anchor"]  # MB/s: higher is better
    assert "[1/1] bench_codec" in done.stdout and "1 of 1 ok" in done.stdout
    assert f"| bench_codec | ok | {bench['wall_s']:.0f} |" in done.stdout  # the BENCHMARKS.md table of the run


def test_a_failing_bench_is_recorded_and_fails_the_run_after_the_rest(tmp_path: Path) -> None:
    benches = tmp_path / "bench"
    benches.mkdir()
    orphan = tmp_path / "orphan.pid"
    (benches / "bench_broken.py").write_text(  # leaves a child behind that ignores SIGINT and SIGTERM
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, "
        "signal.SIG_IGN); signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)'])\n"
        f"open({str(orphan)!r}, 'w').write(str(child.pid))\n"
        "print('anchor missing: datatrove not installed', file=sys.stderr)\nsys.exit(3)\n")
    (benches / "bench_silent.py").write_text("")  # exits 0 but writes no --results file: the contract is broken
    (benches / "bench_codec.py").symlink_to(REPO / "bench" / "bench_codec.py")
    out = tmp_path / "results.json"
    done = run_all("--bench-dir", str(benches), "--out", str(out), "--limit", "120")
    assert done.returncode == 1, done.stdout + done.stderr
    by_name = {b["bench"]: b for b in json.loads(out.read_text())["benches"]}
    assert list(by_name) == ["bench_broken", "bench_codec", "bench_silent"]  # the rest ran after the failure
    broken = by_name["bench_broken"]
    assert broken["status"] == "failed" and broken["exit_status"] == 3
    assert "anchor missing: datatrove not installed" in broken["stderr_tail"]
    assert not alive(int(orphan.read_text())), "what a bench leaves in its process group is killed"
    assert by_name["bench_codec"]["status"] == "ok"
    assert by_name["bench_silent"]["status"] == "no_results" and by_name["bench_silent"]["exit_status"] == 0
    assert "not ok: bench_broken, bench_silent" in done.stdout


def long_bench(pid_file: Path, cleaned: Path) -> str:
    """A bench that starts a child outside its own wait, writes its pid, and runs ~forever; its finally block leaves
    `cleaned` behind, the proof that it was stopped with time for its cleanup."""
    return (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        f"try:\n    time.sleep(600)\nfinally:\n    open({str(cleaned)!r}, 'w').write('stopped what it started')\n"
    )


def test_a_bench_over_its_limit_is_stopped_with_its_children_after_its_cleanup(tmp_path: Path) -> None:
    benches = tmp_path / "bench"
    benches.mkdir()
    pid_file, cleaned = tmp_path / "child.pid", tmp_path / "cleaned"
    (benches / "bench_stuck.py").write_text(long_bench(pid_file, cleaned))
    out = tmp_path / "results.json"
    done = run_all("--bench-dir", str(benches), "--out", str(out), "--limit", "2", sigint_ignored=True)
    assert done.returncode == 1
    (stuck,) = json.loads(out.read_text())["benches"]
    assert stuck["status"] == "timeout" and stuck["exit_status"] is None and "started" in stuck["stdout_tail"]
    assert cleaned.exists(), "the bench's finally block ran: what it started outside its group is stopped"
    assert not alive(int(pid_file.read_text()))


def test_a_stopped_runner_stops_the_bench_it_is_running(tmp_path: Path) -> None:
    benches = tmp_path / "bench"
    benches.mkdir()
    pid_file, cleaned = tmp_path / "child.pid", tmp_path / "cleaned"
    (benches / "bench_long.py").write_text(long_bench(pid_file, cleaned))
    runner = subprocess.Popen([sys.executable, str(RUNNER), "--bench-dir", str(benches), "--out", str(tmp_path / "r.json")],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and runner.poll() is None, "the bench never started"
        time.sleep(0.1)
    runner.terminate()  # what `timeout` sends
    assert runner.wait(timeout=120) != 0
    assert cleaned.exists(), "the bench got SIGINT and ran its finally block"
    assert not alive(int(pid_file.read_text()))


def test_unknown_bench_name_is_a_usage_error() -> None:
    done = run_all("--only", "no_such_bench")
    assert done.returncode == 2 and "no benchmark named bench_no_such_bench" in done.stderr
