"""Run an untrusted Python program under bubblewrap, with limits the program cannot lift.

What the sandbox holds: the interpreter the grader runs under (`sys.base_prefix`: its binary, its shared library and
its standard library, with `site-packages` hidden), the system's shared libraries, a minimal /dev and a private tmpfs
/tmp. Nothing else: not the venv, not /root, not /work, not ember's configs or Kafka credentials, and no /proc. It
gets new user, pid, ipc, uts, net and cgroup namespaces, runs as uid/gid 65534 with no capabilities, cannot create
further user namespaces, dies with the grader and has its own session (no terminal signals). The harness is the
pid namespace's init (`--as-pid-1`): the completion cannot SIGKILL it, and bwrap reaps it directly, so no orphaned
init waits for the host's init to reap it while its pids stay charged to the slot.

Limits. rlimits (CPU seconds, address space, processes, file size, open files) are set by the harness in the
completion's process before its first line runs. The wall clock is kept here: past it the whole sandbox is killed
(SIGKILL to the harness, the
namespace's init: the kernel takes every process in it along) and reaped. stdout and
stderr are read with a bound; past it the sandbox is killed too. When the grader runs as root, RLIMIT_NPROC binds
nothing (the kernel exempts uid 0, which the sandbox's uid maps to), so each concurrent slot gets its own pids
cgroup with `pids.max`; it also lets the sandbox check that no process outlives a run.

No seccomp filter: no maintained Python binding of libseccomp installs into this interpreter (Debian's
python3-seccomp is built for the system Python; `pyseccomp` has had no release since 2021), and writing BPF by hand
is what this module should not do. Sockets fail anyway: the network namespace has only a down loopback.
"""

from __future__ import annotations

import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import psutil

SANDBOX_UID = 65534
REPORT_LIMIT = 1 << 20
STARTUP_S = 30.0
"""How long the interpreter and harness may take to start before the wall clock runs (`wall_s` counts from the
harness's "started"): a sandbox not started by then is a sandbox_error, not the completion's timeout."""


class SandboxUnavailable(RuntimeError):
    """bwrap, the interpreter or the process limit cannot be set up on this machine; raised once, at start."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. Sizes in MiB; `output_bytes` caps stdout and stderr together."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    processes: int = 32
    file_size_mb: int = 16
    open_files: int = 64
    output_bytes: int = 1 << 20
    tmp_mb: int = 64

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"sandbox limit {spec.name} must be a positive number, got {value!r}")

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """(soft, hard) per `resource` constant name, for the harness to apply to the completion's process. The
        CPU hard limit is a second above the soft one, so the kernel sends SIGXCPU (a timeout) before SIGKILL."""
        cpu = int(self.cpu_s)
        limits = {
            "RLIMIT_AS": int(self.memory_mb) << 20,
            "RLIMIT_NPROC": int(self.processes),
            "RLIMIT_FSIZE": int(self.file_size_mb) << 20,
            "RLIMIT_NOFILE": int(self.open_files),
        }
        return {"RLIMIT_CPU": (cpu, cpu + 1)} | {name: (value, value) for name, value in limits.items()}


@dataclass(frozen=True)
class SandboxRun:
    """What one run left: the harness's report channel (`started`, then its last line), output and how it ended."""

    started: bool
    report: str | None
    stdout: bytes
    stderr: bytes
    returncode: int
    timed_out: bool
    output_exceeded: bool
    wall_s: float


class _PidsCgroups:
    """One pids cgroup per slot, so a fork bomb in one run cannot starve the runs beside it."""

    def __init__(self, slots: int, max_pids: int) -> None:
        try:
            self.base = _pids_cgroup_root() / f"ember-sandbox-{os.getpid()}-{id(self):x}"
        except OSError as error:
            raise SandboxUnavailable(f"running as root and no usable pids cgroup: {error}") from error
        try:
            self.base.mkdir()
            for slot in range(slots):
                path = self.base / f"slot-{slot}"
                path.mkdir()
                # The harness and bwrap's init count too, hence the headroom over the completion's own limit.
                (path / "pids.max").write_text(f"{max_pids + 4}\n")
        except OSError as error:
            self.close()
            raise SandboxUnavailable(f"cannot create pids cgroups under {self.base.parent}: {error}") from error

    def procs(self, slot: int) -> Path:
        return self.base / f"slot-{slot}" / "cgroup.procs"

    def drain(self, slot: int) -> None:
        """Kill and wait out anything left in the slot. A pid namespace tears down asynchronously, and a pid is
        uncharged only when its process is released, after it leaves cgroup.procs: wait for `pids.current` 0."""
        path = self.base / f"slot-{slot}"
        deadline = time.monotonic() + 5.0
        while int((path / "pids.current").read_text()) > 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sandbox slot {slot}: processes survived SIGKILL for 5 s")
            for pid in (path / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    def close(self) -> None:
        if not self.base.exists():
            return
        for path in sorted(self.base.glob("slot-*")):
            path.rmdir()
        self.base.rmdir()


def _pids_cgroup_root() -> Path:
    """The grader's own cgroup in the pids hierarchy (cgroup v1 `pids` or v2 with the pids controller)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            return Path("/sys/fs/cgroup/pids") / path.lstrip("/")
        if controllers == "" and "pids" in Path("/sys/fs/cgroup/cgroup.controllers").read_text().split():
            root = Path("/sys/fs/cgroup") / path.lstrip("/")
            (root / "cgroup.subtree_control").write_text("+pids\n")
            return root
    raise SandboxUnavailable("running as root and no pids cgroup is available: RLIMIT_NPROC does not bind uid 0")


def _interpreter_binds() -> tuple[str, list[str]]:
    """The interpreter, its shared library and its standard library, bound read-only at their own paths (the
    binary's rpath names the library's), with site-packages hidden: no third-party code in the sandbox."""
    base = Path(sys.base_prefix)
    exe = base / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = Path(sysconfig.get_path("stdlib", vars={"installed_base": str(base), "base": str(base)}))
    paths = [exe, stdlib]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        paths.append(Path(sysconfig.get_config_var("LIBDIR")) / sysconfig.get_config_var("INSTSONAME"))
    for path in paths:
        if not path.exists():
            raise SandboxUnavailable(f"the interpreter's {path} does not exist")
    args: list[str] = []
    for path in paths:
        args += ["--ro-bind", str(path), str(path)]
    if (stdlib / "site-packages").is_dir():
        args += ["--tmpfs", str(stdlib / "site-packages"), "--remount-ro", str(stdlib / "site-packages")]
    for lib in ("/usr/lib", "/usr/lib64", "/lib", "/lib64"):
        if os.path.islink(lib):
            args += ["--symlink", os.readlink(lib), lib]
        elif os.path.isdir(lib):
            args += ["--ro-bind", lib, lib]
    return str(exe), args


class Sandbox:
    """Runs a harness script under bwrap; `slots` runs may be in flight at once (one per grader worker)."""

    def __init__(self, limits: SandboxLimits, slots: int = 1) -> None:
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxUnavailable("bwrap not found: install Debian's bubblewrap (infra/setup-env.sh does)")
        self.limits = limits
        self._bwrap = bwrap
        self._python, self._binds = _interpreter_binds()
        self._cgroups = _PidsCgroups(slots, limits.processes) if os.geteuid() == 0 else None
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(slots):
            self._slots.put(slot)

    def close(self) -> None:
        if self._cgroups is not None:
            self._cgroups.close()

    def run(self, harness: str, stdin: bytes) -> SandboxRun:
        """Run `python -I -S -c harness REPORT_FD` with `stdin` as its standard input."""
        slot = self._slots.get()
        try:
            return self._run(slot, harness, stdin)
        finally:
            self._slots.put(slot)

    def _command(self, slot: int, harness: str, report_fd: int) -> list[str]:
        bwrap = [
            self._bwrap, "--unshare-all", "--unshare-user", "--disable-userns",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--cap-drop", "ALL",
            "--as-pid-1", "--die-with-parent", "--new-session", "--clearenv", "--setenv", "HOME", "/tmp",
            *self._binds,
            "--dev", "/dev", "--size", str(int(self.limits.tmp_mb) << 20), "--tmpfs", "/tmp", "--chdir", "/tmp",
            self._python, "-I", "-S", "-c", harness, str(report_fd),
        ]  # fmt: skip
        if self._cgroups is None:
            return bwrap
        # sh joins the slot's cgroup and becomes bwrap, so every process of the run is born inside it.
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self._cgroups.procs(slot)), *bwrap]

    def _run(self, slot: int, harness: str, stdin: bytes) -> SandboxRun:
        report_r, report_w = os.pipe()
        stdin_fd = os.memfd_create("sandbox-stdin", os.MFD_CLOEXEC)
        start = time.monotonic()
        try:
            os.write(stdin_fd, stdin)
            os.lseek(stdin_fd, 0, os.SEEK_SET)
            process = subprocess.Popen(
                self._command(slot, harness, report_w), stdin=stdin_fd, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=(report_w,), start_new_session=True,
            )  # fmt: skip
        except BaseException:
            os.close(report_r)
            raise
        finally:
            os.close(report_w)
            os.close(stdin_fd)
        streams = _Streams(process, report_r, self.limits.output_bytes)

        def deadline() -> float:  # the wall clock runs from the harness's "started": a loaded host's slow
            # interpreter start is not the completion's time (a right answer must not become a timeout)
            if streams.started_at is None:
                return start + max(STARTUP_S, self.limits.wall_s)
            return streams.started_at + self.limits.wall_s

        try:
            timed_out = not streams.read_until(deadline)
            if not timed_out and not streams.exceeded:
                try:
                    process.wait(timeout=max(0.0, deadline() - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            _kill(process)
            process.wait()
            streams.close()
            if self._cgroups is not None:
                self._cgroups.drain(slot)
        lines = bytes(streams.report).decode("utf-8", "replace").splitlines()
        return SandboxRun(
            started=bool(lines) and lines[0] == "started",
            report=lines[-1] if len(lines) > 1 else None,
            stdout=bytes(streams.stdout),
            stderr=bytes(streams.stderr),
            returncode=process.returncode,
            timed_out=timed_out and not streams.exceeded,
            output_exceeded=streams.exceeded,
            wall_s=time.monotonic() - start,
        )


class _Streams:
    """stdout, stderr and the report pipe, read together with a byte bound and a deadline."""

    def __init__(self, process: subprocess.Popen[bytes], report_fd: int, output_bytes: int) -> None:
        assert process.stdout is not None and process.stderr is not None
        self.process = process
        self.limit = output_bytes
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.report = bytearray()
        self.exceeded = False
        self.started_at: float | None = None  # when the harness reported "started"
        self.report_fd = report_fd
        self.selector = selectors.DefaultSelector()
        self.selector.register(process.stdout.fileno(), selectors.EVENT_READ, self.stdout)
        self.selector.register(process.stderr.fileno(), selectors.EVENT_READ, self.stderr)
        self.selector.register(report_fd, selectors.EVENT_READ, self.report)

    def read_until(self, deadline: Callable[[], float]) -> bool:
        """Read until every stream is closed (True), the deadline passes (False) or output passes its bound; the
        deadline is asked again after every read (it moves once the harness has started)."""
        while self.selector.get_map():
            remaining = deadline() - time.monotonic()
            if remaining <= 0:
                return False
            for key, _ in self.selector.select(remaining):
                data = os.read(key.fd, 65536)
                if not data:
                    self.selector.unregister(key.fd)
                    continue
                key.data.extend(data)
                if key.data is self.report:
                    if self.started_at is None and self.report.startswith(b"started\n"):
                        self.started_at = time.monotonic()
                    if len(self.report) > REPORT_LIMIT:
                        self.selector.unregister(key.fd)
                elif len(self.stdout) + len(self.stderr) > self.limit:
                    self.exceeded = True
                    return True
        return True

    def close(self) -> None:
        self.selector.close()
        os.close(self.report_fd)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


def _kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the sandbox's init, the harness (the pid namespace goes with it), and let bwrap reap it, so nothing
    is orphaned to a system init that may reap late; then bwrap's process group, if bwrap has not exited."""
    if process.poll() is not None:
        return
    try:
        inits = psutil.Process(process.pid).children()
    except psutil.NoSuchProcess:
        inits = []
    for init in inits:
        try:
            init.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        process.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
