"""Dataflow cannot be reached here: its options are validated with Beam's own validator, the flex
template's metadata and Dockerfile are checked against the code, and the template's entry point
runs for real on FnApiRunner."""

from __future__ import annotations

import json
import re
from pathlib import Path

import apache_beam
import pytest
import yaml

from ember.configs import CorpusConfigError
from ember.pipelines import flex_main
from ember.pipelines.corpus_build import prepare_options
from ember.pipelines.corpus_report import read_stats
from ember.pipelines.runners import default_local_args, local_args, with_defaults
from ember.demo.sample_corpus import write_sample_corpus

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "infra" / "dataflow"
GOOD = ["--runner=DataflowRunner", "--project=ember-prod", "--region=us-central1",
        "--temp_location=gs://ember-corpus/tmp", f"--setup_file={ROOT / 'pyproject.toml'}"]


def test_no_runner_means_the_multiprocess_fnapi_default() -> None:
    assert with_defaults([]) == default_local_args()
    assert local_args(4) == ["--runner=FnApiRunner", "--direct_running_mode=multi_processing", "--direct_num_workers=4"]
    assert local_args(1) == ["--runner=FnApiRunner"], "one core: in-process, no worker to serialise to"
    assert with_defaults(["--runner=FlinkRunner", "--flink_master=[local]"]) == ["--runner=FlinkRunner", "--flink_master=[local]"]


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


def test_dockerfile_points_at_the_entry_point_and_the_installed_beam() -> None:
    dockerfile = (TEMPLATE / "Dockerfile").read_text()
    workdir = re.search(r"ARG WORKDIR=(\S+)", dockerfile).group(1)
    py_file = re.search(r'FLEX_TEMPLATE_PYTHON_PY_FILE="\$\{WORKDIR\}/(\S+)"', dockerfile).group(1)
    assert workdir == "/template" and (ROOT / py_file).is_file() and py_file == "ember/pipelines/flex_main.py"
    assert f"apache/beam_python3.12_sdk:{apache_beam.__version__}" in dockerfile
    assert f'"apache-beam[gcp]=={apache_beam.__version__}"' in dockerfile
    for copied in re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile, re.M):
        assert all((ROOT / p).exists() for p in copied.split()), copied
    readme = (TEMPLATE / "README.md").read_text()
    assert "--metadata-file infra/dataflow/metadata.json" in readme and "--parameters config=gs://" in readme


def test_flex_entry_point_runs_the_build(tmp_path: Path) -> None:
    sample = write_sample_corpus(tmp_path / "in")
    config = tmp_path / "corpus.yaml"
    config.write_text(yaml.safe_dump(sample.config(str(tmp_path / "out"))))
    assert flex_main.main(["--config", str(config), "--runner=FnApiRunner"]) == "DONE"
    assert read_stats(str(tmp_path / "out"))["totals"]["balanced"]
