"""Beam pipeline options for `ember corpus build`: the local default, and checks before a Dataflow submit.

The user's Beam options pass through unchanged. Only when no `--runner` is given does ember pick
`FnApiRunner` in multi-processing mode with one worker per core (in-process on a one-core machine,
where a worker process would only add serialisation): Beam's plain DirectRunner first tries to
download the Prism runner from GitHub, which offline machines cannot reach.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from apache_beam.options.pipeline_options import (
    GoogleCloudOptions,
    PipelineOptions,
    PortableOptions,
    SetupOptions,
    StandardOptions,
    WorkerOptions,
)
from apache_beam.options.pipeline_options_validator import PipelineOptionsValidator
from apache_beam.runners.runner import PipelineResult


class BuildFailed(RuntimeError):
    """The Beam job did not finish in state DONE."""


def local_args(workers: int) -> list[str]:
    if workers <= 1:
        return ["--runner=FnApiRunner"]
    return ["--runner=FnApiRunner", "--direct_running_mode=multi_processing", f"--direct_num_workers={workers}"]


def default_local_args() -> list[str]:
    return local_args(os.cpu_count() or 1)


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
        # Keep each TaskManager's SDK harness for the next stages: a fresh Python worker per stage would
        # import ember (and its models) again for each of the job's ~240 tasks.
        "--environment_cache_millis=600000",
    ]


def with_defaults(beam_args: list[str]) -> list[str]:
    """`beam_args` as given (`--flink_cluster` expanded), or the local FnApiRunner default when they name no runner."""
    if FLINK_CLUSTER_FLAG in beam_args:
        return flink_cluster_args() + [a for a in beam_args if a != FLINK_CLUSTER_FLAG]
    if PipelineOptions(beam_args).view_as(StandardOptions).runner is None:
        return default_local_args() + list(beam_args)
    return list(beam_args)


def runner_name(options: PipelineOptions) -> str:
    return (options.view_as(StandardOptions).runner or "").rsplit(".", 1)[-1]


def finish(result: PipelineResult, options: PipelineOptions) -> str:
    """Wait for the job and return its final state; a job that ends FAILED or CANCELLED raises `BuildFailed`.

    A portable runner (the Flink session cluster) reports a failed job as a RuntimeError carrying the job
    server's whole Java stack trace, which the CLI would print as a traceback. `BuildFailed` gives it one line
    instead (runner, state, the error's first line); Beam has already logged the full text into the job log.
    """
    try:
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
