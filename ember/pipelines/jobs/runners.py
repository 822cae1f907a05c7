"""Beam pipeline options for `ember corpus build`: the local default, and checks before a Dataflow submit.

The user's Beam options pass through unchanged. Only when no `--runner` is given does ember pick
`FnApiRunner`: in multi-processing mode with one worker per core, or in this process when the input is
at most `SMALL_INPUT_BYTES` or the machine has one core. Worker processes cost seconds each job (spawn,
imports, channels), more than a small input's work, which a second core cannot win back. Beam's plain
DirectRunner is never the default: it first tries to download the Prism runner from GitHub, which
offline machines cannot reach. The user's options come after the default, so
`--direct_running_mode=multi_processing --direct_num_workers=N` overrides the choice either way.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from apache_beam import Pipeline
from apache_beam.options.pipeline_options import (
    GoogleCloudOptions,
    PipelineOptions,
    PortableOptions,
    SetupOptions,
    StandardOptions,
    WorkerOptions,
)
from apache_beam.options.pipeline_options_validator import PipelineOptionsValidator
from apache_beam.runners.runner import PipelineResult, PipelineState

from ember.files import is_url
from ember.pipelines.jobs.process import SIGNALS, Interrupted

CANCEL_WAIT_SECONDS = 4.0
"""How long a stopped build waits for its cancelled job to end before it exits anyway (under the job
process's grace period, job_process.GRACE_SECONDS)."""


class BuildFailed(RuntimeError):
    """The Beam job did not finish in state DONE."""


def local_args(workers: int) -> list[str]:
    if workers <= 1:
        return ["--runner=FnApiRunner"]
    return ["--runner=FnApiRunner", "--direct_running_mode=multi_processing", f"--direct_num_workers={workers}"]


SMALL_INPUT_BYTES = 8 * 1024 * 1024
"""Inputs up to this size build in-process and as one fused job: about 8 s of single-core work, the most a
many-core machine could lose against worker processes' start-up (bench/bench_corpus_small.py)."""


def is_small(input_bytes: int | None) -> bool:
    """`input_bytes` is known (all inputs local) and at most `SMALL_INPUT_BYTES`."""
    return input_bytes is not None and input_bytes <= SMALL_INPUT_BYTES


def default_local_args(input_bytes: int | None = None) -> list[str]:
    return local_args(1 if is_small(input_bytes) else os.cpu_count() or 1)


# `--flink_cluster` stands for the options that target the session cluster of infra/flink-cluster.sh.
FLINK_CLUSTER_FLAG = "--flink_cluster"


def flink_cluster_args(env: Mapping[str, str] = os.environ) -> list[str]:
    """Beam options for the session cluster (`infra/flink-cluster.sh args` prints the same, from the same ports).

    The job goes to Beam's Flink job server, which submits it to the JobManager's REST port; the Python
    SDK harness runs in the cluster's worker pool (EXTERNAL environment), one slot per TaskManager.
    """
    def port(name: str, default: int) -> int:
        value = env.get(name, str(default))
        if not value.isdigit() or not 0 < int(value) < 65536:
            raise ValueError(f"{name}={value!r} is not a TCP port (1-65535)")
        return int(value)

    parallelism = port("EMBER_FLINK_TASKMANAGERS", 2) * port("EMBER_FLINK_SLOTS", 1)
    return [
        "--runner=PortableRunner",
        f"--job_endpoint=127.0.0.1:{port('EMBER_FLINK_JOB_PORT', 18099)}",
        f"--artifact_endpoint=127.0.0.1:{port('EMBER_FLINK_ARTIFACT_PORT', 18098)}",
        "--environment_type=EXTERNAL",
        f"--environment_config=127.0.0.1:{port('EMBER_FLINK_WORKER_POOL_PORT', 18050)}",
        f"--parallelism={parallelism}",
        f"--flink_master=127.0.0.1:{port('EMBER_FLINK_REST_PORT', 18081)}",
        # Keep each TaskManager's SDK harness for the next stages: a fresh Python worker per stage would
        # import ember (and its models) again for each of the job's ~240 tasks.
        "--environment_cache_millis=600000",
    ]


def with_defaults(beam_args: list[str], input_bytes: int | None = None) -> list[str]:
    """`beam_args` as given (`--flink_cluster` expanded), or the local FnApiRunner default for `input_bytes` of input
    (None: unknown) when they name no runner.

    A job for a Flink cluster ember can reach over REST gets a `--job_name` when it has none: the name is
    how a stopped build finds its Flink job to cancel it (see `cancelled_on_stop`).
    """
    if FLINK_CLUSTER_FLAG in beam_args:
        args = flink_cluster_args() + [a for a in beam_args if a != FLINK_CLUSTER_FLAG]
    elif PipelineOptions(beam_args).view_as(StandardOptions).runner is None:
        return default_local_args(input_bytes) + list(beam_args)
    else:
        args = list(beam_args)
    options = PipelineOptions(args)
    if flink_rest_url(options) and not options.view_as(GoogleCloudOptions).job_name:
        args.append(f"--job_name=ember-{uuid.uuid4().hex[:12]}")
    return args


def flink_rest_url(options: PipelineOptions) -> str | None:
    """The REST address of the Flink cluster a Flink or portable job goes to, where the options name one
    (`--flink_master=host:port`; not `[local]` or `[auto]`)."""
    master = options.get_all_options().get("flink_master") or ""
    if runner_name(options) not in ("FlinkRunner", "PortableRunner") or not master or master.startswith("["):
        return None
    return master if is_url(master) else f"http://{master}"


def runner_name(options: PipelineOptions) -> str:
    return (options.view_as(StandardOptions).runner or "").rsplit(".", 1)[-1]


def finish(result: PipelineResult, options: PipelineOptions) -> str:
    """Wait for the job and return its final state; a job that ends FAILED or CANCELLED raises `BuildFailed`.

    A portable runner (the Flink session cluster) reports a failed job as a RuntimeError carrying the job
    server's whole Java stack trace, which the CLI would print as a traceback. `BuildFailed` gives it one line
    instead (runner, state, the error's first line); Beam has already logged the full text into the job log.
    """
    try:
        with cancelled_on_stop(result, options):
            return str(result.wait_until_finish())
    except RuntimeError as exc:
        state = result.state
        if state not in ("FAILED", "CANCELLED"):
            raise
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "no error text")
        beams = re.match(r"Pipeline (\S+) failed in state \w+: (.*)", first)  # Beam's wording of a portable failure
        job, cause = (f" {beams[1]}", beams[2]) if beams else ("", first)
        raise BuildFailed(
            f"the {runner_name(options)} job{job} failed: it ended in state {state} ({cause[:300]}); "
            "Beam wrote the runner's full error into the job log"
        ) from exc


def run_pipeline(p: Pipeline, options: PipelineOptions, what: str) -> str:
    """`p` run to the end (`finish`), with one log line as it starts and one as it ends: the job log then says how
    many Beam jobs a build ran, in which process, and the seconds each took."""
    log = logging.getLogger(__name__)
    log.info("beam job started: %s on %s in process %d", what, runner_name(options), os.getpid())
    started = time.monotonic()
    state = finish(p.run(), options)
    log.info("beam job ended: %s, state %s after %.1f s", what, state, time.monotonic() - started)
    return state


class _Stop(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def cancelled_on_stop(result: PipelineResult, options: PipelineOptions) -> Iterator[None]:
    """SIGINT or SIGTERM while the job runs cancels it on its runner, then does what it did before.

    A portable (Flink) or Dataflow job runs on its cluster, not in this process: without a cancel it goes on
    after `ember corpus build` stops, holding the cluster's slots. A signal that was ignored stays ignored;
    signal handlers belong to the main thread, so elsewhere (a library caller's thread) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        raise _Stop(signum)

    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, stop)
    try:
        yield
    except _Stop as received:
        for s in previous:  # a second signal (a process group and its members both signalled) waits for the cancel
            signal.signal(s, lambda *_: None)
        _cancel(result, options)
        _restore(previous)
        handler = previous[received.signum]
        if callable(handler):
            handler(received.signum, None)
        else:
            os.kill(os.getpid(), received.signum)  # SIG_DFL: the default action, the process ends
        raise Interrupted(received.signum) from None  # a handler that let the signal pass
    finally:
        _restore(previous)


def _restore(handlers: Mapping[int, object]) -> None:
    for s, handler in handlers.items():
        signal.signal(s, handler)  # type: ignore[arg-type]


def _cancel(result: PipelineResult, options: PipelineOptions) -> None:
    """Cancel the job through Beam, and on its Flink cluster where ember can reach one: Beam 2.62's Flink job
    server marks its own invocation CANCELLED but leaves the job running on a session cluster. Waits a
    little for the job to end; the job log says how that went."""
    log, name = logging.getLogger(__name__), runner_name(options)
    deadline = time.monotonic() + CANCEL_WAIT_SECONDS
    try:
        result.cancel()
        while not PipelineState.is_terminal(state := result.state) and time.monotonic() < deadline:
            time.sleep(0.5)
        log.warning("stopped: the %s job was cancelled (state %s)", name, state)
    except Exception as exc:  # the runner is gone or refuses: the signal still stops the build
        log.warning("cancelling the %s job failed: %s", name, exc)
    rest, job_name = flink_rest_url(options), options.view_as(GoogleCloudOptions).job_name
    if rest and job_name:
        try:
            log.warning("stopped: Flink job(s) %s cancelled at %s", _cancel_flink_jobs(rest, job_name, deadline), rest)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("cancelling Flink job %r at %s failed: %s", job_name, rest, exc)


FLINK_DONE = {"FINISHED", "FAILED", "CANCELED", "SUSPENDED"}


def _cancel_flink_jobs(rest: str, job_name: str, deadline: float) -> list[str]:
    """PATCH /jobs/<id>?mode=cancel (Flink's REST API) for each unfinished job called `job_name`; wait for them."""
    def jobs() -> list[dict]:
        with urllib.request.urlopen(f"{rest}/jobs/overview", timeout=3) as response:
            return [j for j in json.load(response)["jobs"] if j["name"] == job_name]

    ids = [j["jid"] for j in jobs() if j["state"] not in FLINK_DONE]
    for jid in ids:
        urllib.request.urlopen(urllib.request.Request(f"{rest}/jobs/{jid}?mode=cancel", method="PATCH"), timeout=3).close()
    while time.monotonic() < deadline and any(j["state"] not in FLINK_DONE for j in jobs() if j["jid"] in ids):
        time.sleep(0.5)
    return ids


def runs_locally(options: PipelineOptions) -> bool:
    """Workers share this machine's disk: FnApiRunner, an embedded Flink with LOOPBACK workers, or the local
    session cluster's worker pool (EXTERNAL on 127.0.0.1)."""
    name = runner_name(options)
    if name in ("FnApiRunner", "DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner"):
        return True
    portable = options.view_as(PortableOptions)
    flink_master = options.get_all_options().get("flink_master")
    if name not in ("FlinkRunner", "PortableRunner"):
        return False
    if portable.environment_type == "EXTERNAL":
        return (portable.environment_config or "").split(":")[0] in ("127.0.0.1", "localhost")
    return portable.environment_type == "LOOPBACK" and flink_master == "[local]"


def dataflow_problems(options: PipelineOptions) -> list[str]:
    """Everything that would make a Dataflow submit fail, found before any network call.

    Beam's own validators check project, region and the gs:// locations; ember adds that its package
    must reach the workers (`--setup_file` pointing at an existing pyproject.toml/setup.py, or a
    prebuilt `--sdk_container_image`). GoogleCloudOptions.validate is not called as a whole: with the
    GCS client installed it probes the buckets over the network (soft-delete policy, and creating a
    default bucket when both locations are bad), so its pure checks are called one by one.
    """
    gcp = options.view_as(GoogleCloudOptions)
    if gcp.temp_location and not gcp.staging_location:
        gcp.staging_location = gcp.temp_location.rstrip("/") + "/staging"  # what DataflowRunner derives
    from apache_beam.runners.dataflow.dataflow_runner import DataflowRunner

    validator = PipelineOptionsValidator(options, DataflowRunner())
    problems = [
        problem
        for view in validator.OPTIONS
        if view is not GoogleCloudOptions and callable(view.__dict__.get("validate"))
        for problem in options.view_as(view).validate(validator)
    ]
    problems += validator.validate_gcs_path(gcp, "temp_location") + validator.validate_gcs_path(gcp, "staging_location")
    problems += validator.validate_cloud_options(gcp)
    setup_file = options.view_as(SetupOptions).setup_file
    image = options.view_as(WorkerOptions).sdk_container_image
    if setup_file:
        path = Path(setup_file)
        if path.name not in ("pyproject.toml", "setup.py"):
            problems.append(f"--setup_file must name pyproject.toml or setup.py, got '{setup_file}'")
        elif not path.is_file():
            problems.append(f"--setup_file '{setup_file}' does not exist")
    elif not image:
        problems.append("ember must reach the workers: pass --setup_file=./pyproject.toml or --sdk_container_image=...")
    return problems
