"""`ember corpus dataflow-render`: everything a Dataflow submit would send, written to a local folder
without a network call, so a job can be checked where the service cannot be reached.

Beam's own DataflowRunner does the work: `--template_location` makes it write the job request
(`job.json`) instead of submitting it, and a local staging location makes it copy the pipeline proto
and the packages the workers would install (`--setup_file`, `--extra_package`) into `OUT/staging`.
The options are validated first with `runners.dataflow_problems`, against the gs:// locations as
given; only then are staging, auth and the endpoint pointed away from the network: no credentials
(`--no_auth`) and a closed localhost endpoint, so a call that slipped through fails at once.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ember.configs import CorpusConfigError
from ember.pipelines.corpus.config import CorpusConfig

CLOSED_ENDPOINT = "http://localhost:1"
FLEX_METADATA = Path(__file__).resolve().parents[3] / "infra" / "dataflow" / "metadata.json"


@dataclass(frozen=True)
class Rendered:
    job: Path
    transforms: int
    leaf_transforms: int
    staged: dict[str, int]
    flex_spec: Path | None


def render_problems(beam_args: list[str]) -> list[str]:
    """What stops a render: the Dataflow options' own problems, or a `--setup_file` Beam cannot package here."""
    from apache_beam.options.pipeline_options import PipelineOptions, SetupOptions

    from ember.pipelines.jobs.runners import dataflow_problems, runner_name

    options = PipelineOptions(beam_args)
    if runner_name(options) != "DataflowRunner":
        return ["dataflow-render renders a Dataflow job: pass --runner=DataflowRunner"]
    problems = dataflow_problems(options)
    setup_file = options.view_as(SetupOptions).setup_file
    if setup_file and Path(setup_file).is_file():
        missing = missing_build_tools(Path(setup_file))
        if missing:
            problems.append(
                f"--setup_file needs {', '.join(missing)} in this environment (Beam packages ember with "
                "`python -m build --no-isolation --sdist`, which uses the build-system requirements as installed): "
                "install them, or ship ember in --sdk_container_image instead")
    return problems


def missing_build_tools(setup_file: Path) -> list[str]:
    """The `build` package and the setup file's build-system requirements that are not installed here."""
    from packaging.requirements import Requirement

    missing = [] if importlib.util.find_spec("build") else ["build"]
    if setup_file.name == "pyproject.toml":
        requires = tomllib.loads(setup_file.read_text()).get("build-system", {}).get("requires", [])
        for name in (Requirement(r).name for r in requires):
            try:
                importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                missing.append(name)
    return missing


def render(config: CorpusConfig, beam_args: list[str], out: Path) -> Rendered:
    """Write the job request, the staged files and the flex template spec of `config` on Dataflow into
    `out` (new or empty). Raises CorpusConfigError when the options cannot be rendered."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions, TestOptions, WorkerOptions

    from ember.pipelines.corpus.pipeline import build_pipeline

    problems = render_problems(beam_args)
    if problems:
        raise CorpusConfigError("Dataflow options are unusable:\n  " + "\n  ".join(problems))
    if out.exists() and any(out.iterdir()):
        raise CorpusConfigError(f"{out} is not empty: dataflow-render writes into a new or empty folder")
    staging = out / "staging"
    staging.mkdir(parents=True)
    # dry_run while the Pipeline validates its options: it skips the bucket probes (soft-delete policy).
    p = beam.Pipeline(options=PipelineOptions([*beam_args, "--dry_run=True"]))
    build_pipeline(p, config)
    options = p.options
    gcp = options.view_as(GoogleCloudOptions)
    gcp.staging_location, gcp.template_location = str(staging), str(out / "job.json")
    gcp.no_auth, gcp.dataflow_endpoint = True, CLOSED_ENDPOINT
    options.view_as(TestOptions).dry_run = False
    try:
        p.run(test_runner_api=False)  # no round trip through the proto: that validates again, probing buckets
    except (RuntimeError, OSError) as exc:
        raise CorpusConfigError(f"Beam could not stage the job: {exc}") from exc
    transforms = proto_transforms(staging / "pipeline.pb")
    return Rendered(
        job=out / "job.json",
        transforms=len(transforms),
        leaf_transforms=sum(1 for t in transforms.values() if not t.subtransforms),
        staged={f.name: f.stat().st_size for f in sorted(staging.iterdir())},
        flex_spec=write_flex_spec(out, options.view_as(WorkerOptions).sdk_container_image),
    )


def proto_transforms(pipeline_pb: Path) -> dict:
    """The staged pipeline's transforms by id (Dataflow runner v2 sends the graph as this proto, not as job steps)."""
    from apache_beam.portability.api import beam_runner_api_pb2

    return dict(beam_runner_api_pb2.Pipeline.FromString(pipeline_pb.read_bytes()).components.transforms)


def write_flex_spec(out: Path, image: str | None) -> Path | None:
    """The spec `gcloud dataflow flex-template build` writes (image, SDK, metadata); none without the image
    the template runs (`--sdk_container_image`) or outside a checkout (no infra/dataflow/metadata.json)."""
    if not image or not FLEX_METADATA.is_file():
        return None
    spec = {"image": image, "sdkInfo": {"language": "PYTHON"}, "metadata": json.loads(FLEX_METADATA.read_text())}
    path = out / "flex-template.json"
    path.write_text(json.dumps(spec, indent=2) + "\n")
    return path
