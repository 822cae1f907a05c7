"""Beam pipeline options for `ember corpus build`: the local default, and checks before a Dataflow submit.

The user's Beam options pass through unchanged. Only when no `--runner` is given does ember pick
`FnApiRunner` in multi-processing mode with one worker per core (in-process on a one-core machine,
where a worker process would only add serialisation): Beam's plain DirectRunner first tries to
download the Prism runner from GitHub, which offline machines cannot reach.
"""

from __future__ import annotations

import os
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


def local_args(workers: int) -> list[str]:
    if workers <= 1:
        return ["--runner=FnApiRunner"]
    return ["--runner=FnApiRunner", "--direct_running_mode=multi_processing", f"--direct_num_workers={workers}"]


def default_local_args() -> list[str]:
    return local_args(os.cpu_count() or 1)


def with_defaults(beam_args: list[str]) -> list[str]:
    """`beam_args` as given, or the local FnApiRunner default when they name no runner."""
    if PipelineOptions(beam_args).view_as(StandardOptions).runner is None:
        return default_local_args() + list(beam_args)
    return list(beam_args)


def runner_name(options: PipelineOptions) -> str:
    return (options.view_as(StandardOptions).runner or "").rsplit(".", 1)[-1]


def runs_locally(options: PipelineOptions) -> bool:
    """Workers share this machine's disk: FnApiRunner, or an embedded Flink with LOOPBACK workers."""
    name = runner_name(options)
    if name in ("FnApiRunner", "DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner"):
        return True
    portable = options.view_as(PortableOptions)
    flink_master = options.get_all_options().get("flink_master")
    return name in ("FlinkRunner", "PortableRunner") and portable.environment_type == "LOOPBACK" and flink_master == "[local]"


def dataflow_problems(options: PipelineOptions) -> list[str]:
    """Everything that would make a Dataflow submit fail, found before any network call.

    Beam's own validator checks project, region and the gs:// locations; ember adds that its package
    must reach the workers (`--setup_file` pointing at an existing pyproject.toml/setup.py, or a
    prebuilt `--sdk_container_image`).
    """
    gcp = options.view_as(GoogleCloudOptions)
    if gcp.temp_location and not gcp.staging_location:
        gcp.staging_location = gcp.temp_location.rstrip("/") + "/staging"  # what DataflowRunner derives
    from apache_beam.runners.dataflow.dataflow_runner import DataflowRunner

    problems = list(PipelineOptionsValidator(options, DataflowRunner()).validate())
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
