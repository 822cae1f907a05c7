"""Dataflow cannot be reached here: its options are validated with Beam's own validator, the job is
rendered by Beam's DataflowRunner in a namespace without network, the flex template's metadata and
Dockerfile are checked against the code and the lock, and the template's entry point runs for real on
FnApiRunner."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import apache_beam
from apache_beam.options.pipeline_options import PipelineOptions
import pytest
import yaml
from typer.testing import CliRunner

from ember.configs import CorpusConfigError
from ember.pipelines.corpus import flex_main
from ember.pipelines.corpus.build import prepare_options
from ember.pipelines.cli import app
from ember.pipelines.corpus.report import read_stats
from ember.pipelines.corpus.dataflow import missing_build_tools, proto_transforms
from ember.pipelines.quality.decontamination import write_benchmark
from ember.pipelines.jobs.runners import SMALL_INPUT_BYTES, default_local_args, local_args, with_defaults
from ember.demo.sample_corpus import write_sample_corpus

ROOT = Path(__file__).resolve().parents[3]
TEMPLATE = ROOT / "infra" / "dataflow"
GOOD = ["--runner=DataflowRunner", "--project=ember-prod", "--region=us-central1",
        "--temp_location=gs://ember-corpus/tmp", f"--setup_file={ROOT / 'pyproject.toml'}"]


def test_no_runner_means_the_multiprocess_fnapi_default() -> None:
    assert with_defaults([]) == default_local_args()
    assert local_args(4) == ["--runner=FnApiRunner", "--direct_running_mode=multi_processing", "--direct_num_workers=4"]
    assert local_args(1) == ["--runner=FnApiRunner"], "one core: in-process, no worker to serialise to"
    assert with_defaults(["--runner=FlinkRunner", "--flink_master=[local]"]) == ["--runner=FlinkRunner", "--flink_master=[local]"]


def test_a_small_input_runs_in_process_unless_the_options_ask_for_workers() -> None:
    assert with_defaults([], SMALL_INPUT_BYTES) == ["--runner=FnApiRunner"]
    assert with_defaults([], SMALL_INPUT_BYTES + 1) == default_local_args(None) == local_args(os.cpu_count() or 1)
    assert with_defaults([], None) == default_local_args(None), "a URL input's size is unknown: the multi-process default"
    workers = ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]
    options = PipelineOptions(with_defaults(workers, 1)).get_all_options()
    assert (options["runner"], options["direct_running_mode"], options["direct_num_workers"]) == ("FnApiRunner", "multi_processing", 2)
    assert with_defaults(["--runner=FlinkRunner"], 1) == ["--runner=FlinkRunner"]


def test_complete_dataflow_options_pass() -> None:
    args, options = prepare_options(GOOD)
    assert args == GOOD
    assert options.get_all_options()["staging_location"] == "gs://ember-corpus/tmp/staging"


@pytest.mark.parametrize(
    ("drop", "replace", "expected"),
    [
        ("--project=ember-prod", None, "Missing required option: project"),
        ("--region=us-central1", None, "Missing required option: region"),
        ("--temp_location=gs://ember-corpus/tmp", "--temp_location=/tmp/local", "Invalid GCS path (/tmp/local)"),
        (f"--setup_file={ROOT / 'pyproject.toml'}", None, "ember must reach the workers"),
        (f"--setup_file={ROOT / 'pyproject.toml'}", "--setup_file=./requirements.txt", "must name pyproject.toml or setup.py"),
        (f"--setup_file={ROOT / 'pyproject.toml'}", "--setup_file=/nowhere/pyproject.toml", "does not exist"),
    ],
)
def test_each_bad_dataflow_option_is_named(drop: str, replace: str | None, expected: str) -> None:
    args = [a for a in GOOD if a != drop] + ([replace] if replace else [])
    with pytest.raises(CorpusConfigError) as info:
        prepare_options(args)
    assert expected in str(info.value)


def test_a_prebuilt_worker_image_replaces_the_setup_file() -> None:
    args = [a for a in GOOD if not a.startswith("--setup_file")] + ["--sdk_container_image=gcr.io/ember/corpus:1"]
    prepare_options(args)


def test_template_metadata_declares_exactly_the_entry_points_parameters() -> None:
    metadata = json.loads((TEMPLATE / "metadata.json").read_text())
    assert metadata["name"] and metadata["description"] and metadata["streaming"] is False
    declared = {p["name"] for p in metadata["parameters"]}
    accepted = {a.dest for a in flex_main.parser()._actions if a.dest != "help"}
    assert declared == accepted
    for param in metadata["parameters"]:
        assert {"name", "label", "helpText"} <= set(param) and param["isOptional"] is False
        assert param["paramType"] in {"TEXT", "GCS_READ_FILE", "GCS_READ_FOLDER", "GCS_WRITE_FOLDER"}
        regex = re.compile(param["regexes"][0])
        assert regex.match("gs://ember-corpus/configs/corpus.yaml") and not regex.match("/local/corpus.yaml")


def test_dockerfile_points_at_the_entry_point_and_installs_the_lock() -> None:
    dockerfile = (TEMPLATE / "Dockerfile").read_text()
    workdir = re.search(r"ARG WORKDIR=(\S+)", dockerfile).group(1)
    py_file = re.search(r'FLEX_TEMPLATE_PYTHON_PY_FILE="\$\{WORKDIR\}/(\S+)"', dockerfile).group(1)
    assert workdir == "/template" and (ROOT / py_file).is_file() and py_file == "ember/pipelines/corpus/flex_main.py"
    assert f"apache/beam_python3.12_sdk:{apache_beam.__version__}" in dockerfile
    uv_version = re.search(r'^UV_VERSION="(\S+)"', (ROOT / "infra" / "setup-env.sh").read_text(), re.M).group(1)
    assert f"ghcr.io/astral-sh/uv:{uv_version} AS uv" in dockerfile, "the image exports the lock with the project's uv"
    assert "pip install --no-cache-dir --no-deps --require-hashes -r requirements.txt" in dockerfile
    assert "pip install --no-cache-dir --no-deps .\n" in dockerfile, "ember itself adds no package beyond the lock"
    for copied in re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile, re.M):
        assert all((ROOT / p).exists() for p in copied.split()), copied
    readme = (TEMPLATE / "README.md").read_text()
    assert "--metadata-file infra/dataflow/metadata.json" in readme and "--parameters config=gs://" in readme


def test_the_images_export_of_the_lock_is_hashed_and_holds_beam_with_its_cloud_extras(tmp_path: Path) -> None:
    """The Dockerfile's own `uv export` command, run here with the project's uv."""
    uv_version = re.search(r'^UV_VERSION="(\S+)"', (ROOT / "infra" / "setup-env.sh").read_text(), re.M).group(1)
    uv = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ember" / "tools" / f"uv-{uv_version}" / "bin" / "uv"
    command = re.search(r"uv (export [^\\&\n]+?)\s*\\", (TEMPLATE / "Dockerfile").read_text()).group(1).split()
    assert command[-2:] == ["-o", "requirements.txt"]
    subprocess.run([str(uv), *command[:-1], str(tmp_path / "requirements.txt")], cwd=ROOT, check=True, capture_output=True)
    text = (tmp_path / "requirements.txt").read_text()
    entries = [e for e in re.split(r"\n(?=\S)", text) if e.strip() and not e.startswith("#")]
    assert len(entries) > 100 and all(re.search(r"--hash=sha256:[0-9a-f]{64}", e) for e in entries), "pip --require-hashes"
    versions = dict(re.match(r"([a-z0-9][a-z0-9._-]*)==([^\s;]+)", e).groups() for e in entries)
    assert versions["apache-beam"] == apache_beam.__version__
    assert {"google-cloud-storage", "google-cloud-dataflow-client", "boto3"} <= set(versions), "Beam's gcp and aws extras"
    assert "ember" not in versions


def cli_offline(*args: str) -> subprocess.CompletedProcess:
    """`ember corpus ...` in a network namespace of its own: no interface but a down loopback, no credentials."""
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.fail("the offline render runs in a network namespace of its own, and `unshare -rn` is refused here "
                    f"({probe.stderr.strip()}): run the suite as root or allow unprivileged user namespaces")
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "CLOUDSDK_CONFIG")}
    env.update(PYTHONPATH=str(ROOT), HOME=os.environ.get("HOME", "/root"))
    return subprocess.run(["unshare", "-rn", sys.executable, "-c", "from ember.cli import app; app(prog_name='ember')",
                           "corpus", *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def example_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped example config, beside the benchmark files its decontamination section names."""
    folder = tmp_path_factory.mktemp("example")
    shutil.copy(ROOT / "ember" / "pipelines" / "examples" / "corpus.yaml", folder / "corpus.yaml")
    write_benchmark("humaneval", folder / "benchmarks")
    (folder / "benchmarks" / "mbpp.jsonl").write_text(json.dumps({
        "task_id": 2, "text": "Write a function to find the shared elements from the given two lists of numbers",
        "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
        "test_list": ["assert set(similar_elements((3, 4), (4, 5))) == {4}"]}) + "\n")
    return folder / "corpus.yaml"


def test_render_writes_the_job_staged_files_and_flex_spec_without_network(example_config: Path, tmp_path: Path) -> None:
    extra = tmp_path / "ember_extra-0.1.tar.gz"
    with tarfile.open(extra, "w:gz") as tar:
        tar.add(ROOT / "README.md", arcname="ember_extra-0.1/README.md")
    image = "us-docker.pkg.dev/ember-prod/corpus/ember:1"
    out = tmp_path / "render"
    args = [a for a in GOOD if not a.startswith("--setup_file")] + [f"--sdk_container_image={image}",
                                                                   f"--extra_package={extra}", "--max_num_workers=64"]
    result = cli_offline("dataflow-render", str(example_config), str(out), *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pipeline: " in result.stdout and "staged: ember_extra-0.1.tar.gz" in result.stdout
    log = (tmp_path / "render.log").read_text()
    assert f"A template was just created at location {out / 'job.json'}" in log
    for network_sign in ("credentials", "Connecting anonymously", "soft delete", "GCS upload", "localhost:1/"):
        assert network_sign not in log, f"{network_sign!r} in the render log: something tried the network"

    job = json.loads((out / "job.json").read_text())
    assert job["type"] == "JOB_TYPE_BATCH"
    options = job["environment"]["sdkPipelineOptions"]["options"]
    assert (options["project"], options["region"], options["temp_location"]) == ("ember-prod", "us-central1", "gs://ember-corpus/tmp")
    assert options["sdk_container_image"] == image and options["max_num_workers"] == 64
    assert options["no_auth"] is True and options["dataflow_endpoint"] == "http://localhost:1"
    assert job["environment"]["tempStoragePrefix"].startswith("storage.googleapis.com/ember-corpus/tmp")
    pool = job["environment"]["workerPools"][0]
    assert {c["containerImage"] for c in pool["sdkHarnessContainerImages"]} == {image}
    assert {p["name"] for p in pool["packages"]} >= {"ember_extra-0.1.tar.gz", "extra_packages.txt"}

    staged = {p.name: p for p in (out / "staging").iterdir()}
    assert staged["ember_extra-0.1.tar.gz"].read_bytes() == extra.read_bytes()
    transforms = proto_transforms(staged["pipeline.pb"])
    names = {t.unique_name.split("/")[0] for t in transforms.values()}
    assert {"ReadSources", "RedactRejects", "RedactClusters", "AllRejects", "AllStats"} <= names, sorted(names)
    assert any("NearDedup" in n for n in names) and any("Decontaminat" in t.unique_name for t in transforms.values())

    spec = json.loads((out / "flex-template.json").read_text())
    assert spec["image"] == image and spec["sdkInfo"] == {"language": "PYTHON"}
    assert spec["metadata"] == json.loads((TEMPLATE / "metadata.json").read_text())


def test_render_with_the_setup_file_packages_ember(example_config: Path, tmp_path: Path) -> None:
    assert missing_build_tools(ROOT / "pyproject.toml") == [], "build and the build backend are in the lock"
    result = cli_offline("dataflow-render", str(example_config), str(tmp_path / "render"), *GOOD)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "staged: workflow.tar.gz" in result.stdout


def test_a_setup_file_whose_build_backend_is_missing_is_refused_naming_it(example_config: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text('[build-system]\nrequires = ["hatchling>=1.0"]\nbuild-backend = "hatchling.build"\n')
    args = [a for a in GOOD if not a.startswith("--setup_file")] + [f"--setup_file={project / 'pyproject.toml'}"]
    result = CliRunner().invoke(app, ["dataflow-render", str(example_config), str(tmp_path / "render"), *args])
    assert result.exit_code == 2, result.stdout
    assert "--setup_file needs hatchling in this environment" in result.stdout
    assert "Traceback" not in result.stdout and not (tmp_path / "render" / "job.json").exists()


def test_render_names_every_bad_option_on_its_own_line(example_config: Path, tmp_path: Path) -> None:
    args = ["--runner=DataflowRunner", "--region=us-central1", "--temp_location=/tmp/local"]
    result = CliRunner().invoke(app, ["dataflow-render", str(example_config), str(tmp_path / "render"), *args])
    assert result.exit_code == 2
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert "Missing required option: project." in lines
    assert "Invalid GCS path (/tmp/local), given for the option: temp_location." in lines
    assert "ember must reach the workers: pass --setup_file=./pyproject.toml or --sdk_container_image=..." in lines
    assert "Traceback" not in result.stdout and not (tmp_path / "render").exists()
    not_dataflow = CliRunner().invoke(app, ["dataflow-render", str(example_config), str(tmp_path / "r2"), "--runner=FnApiRunner"])
    assert not_dataflow.exit_code == 2 and "pass --runner=DataflowRunner" in not_dataflow.stdout


def test_flex_entry_point_runs_the_build(tmp_path: Path) -> None:
    sample = write_sample_corpus(tmp_path / "in")
    config = tmp_path / "corpus.yaml"
    config.write_text(yaml.safe_dump(sample.config(str(tmp_path / "out"))))
    assert flex_main.main(["--config", str(config), "--runner=FnApiRunner"]) == "DONE"
    assert read_stats(str(tmp_path / "out"))["totals"]["balanced"]
