"""What every config file gets alike (ember.configs): `${VAR}` expansion of parsed values, and a file that is
not UTF-8 text refused as a config error by every tool, with exit code 2 and one line, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ember import configs
from ember.cli import app as ember_app
from ember.configs import ConfigError, CorpusConfigError, MidtrainConfigError
from ember.midtrain.cli import app as midtrain_app
from ember.midtrain.config import load_config as load_midtrain
from ember.pipelines.corpus_config import load_config as load_corpus

REPO = Path(__file__).resolve().parents[1]
MIDTRAIN = yaml.safe_load((REPO / "ember/midtrain/examples/tiny_cpu.yaml").read_text())
UNSET = "EMBER_TEST_NEVER_SET"


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_home_is_expanded_where_midtrain_once_made_a_directory_named_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config = load_midtrain(_write(tmp_path / "run.yaml", {**MIDTRAIN, "run_dir": "${HOME}/runs/tiny"}))
    assert config.run_dir == tmp_path / "home" / "runs" / "tiny"
    assert "${" not in str(config.checkpoint_dir)


def test_defaults_escapes_and_lists(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_TEST_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("EMBER_TEST_EMPTY", "")
    (tmp_path / "c.yaml").write_text(
        "sources: [{name: w, kind: web, inputs: ['${EMBER_TEST_DATA}/a/*.jsonl', '${EMBER_TEST_EMPTY:-b}/*.jsonl']}]\n"
        f"output: {{directory: '${{{UNSET}:-out}}/$${{literal}}'}}\n"
    )
    config = load_corpus(str(tmp_path / "c.yaml"))
    assert config.sources[0].inputs == [str(tmp_path / "data/a/*.jsonl"), str(tmp_path / "b/*.jsonl")]
    assert config.output.directory == str(tmp_path / "out" / "${literal}")


def test_expansion_happens_after_parsing_so_a_value_cannot_change_the_structure(monkeypatch):
    monkeypatch.setenv("EMBER_TEST_YAML", "x\n  injected: [1, 2]")
    data = configs.parse_yaml_mapping("a: ${EMBER_TEST_YAML}\n'${EMBER_TEST_YAML}': 3\n", "f.yaml", ConfigError)
    assert data == {"a": "x\n  injected: [1, 2]", "${EMBER_TEST_YAML}": 3}  # keys are never expanded


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (f"${{{UNSET}}}/runs", f"run.yaml: run_dir: environment variable {UNSET} is not set"),
        ("${HOME", "run.yaml: run_dir: '${' starts no ${NAME} or ${NAME:-default} reference"),
        ("${A:-${B}}", "run.yaml: run_dir: '${' starts no"),
    ],
)
def test_unset_or_malformed_references_are_config_errors_naming_key_and_variable(tmp_path, monkeypatch, value, message):
    monkeypatch.delenv(UNSET, raising=False)
    with pytest.raises(MidtrainConfigError) as info:
        load_midtrain(_write(tmp_path / "run.yaml", {**MIDTRAIN, "run_dir": value}))
    assert message in str(info.value)


def test_unset_variable_deep_in_a_list_is_named_by_its_dotted_key(monkeypatch):
    monkeypatch.delenv(UNSET, raising=False)
    text = f"sources:\n  - {{name: w, kind: web, inputs: [a, 'x/${{{UNSET}}}']}}\n"
    with pytest.raises(CorpusConfigError, match=f"c.yaml: sources.0.inputs.1: environment variable {UNSET} is not set"):
        configs.parse_yaml_mapping(text, "c.yaml", CorpusConfigError)


def test_aliases_are_expanded_once_so_an_alias_bomb_stays_cheap(monkeypatch):
    monkeypatch.setenv("EMBER_TEST_LEAF", "leaf")
    lines = ["l0: &l0 ['${EMBER_TEST_LEAF}', '${EMBER_TEST_LEAF}']"]
    lines += [f"l{i}: &l{i} [*l{i - 1}, *l{i - 1}]" for i in range(1, 40)]  # 2^40 leaves if walked naively
    data = configs.parse_yaml_mapping("\n".join(lines), "bomb.yaml", ConfigError)
    node = data["l39"]
    for _ in range(39):
        node = node[1]
    assert node == ["leaf", "leaf"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'run_dir: "caf\xe9"\n', "not UTF-8 text (byte 0xe9 at offset 13)"),
        (b"\xff\xfer\x00u\x00n\x00", "not UTF-8 text (byte 0xff at offset 0)"),  # UTF-16
        (b"\x7fELF\x02\x01\x01" + bytes(9), "not a text file (byte 0x00 at offset 7)"),
    ],
    ids=["latin-1", "utf-16", "binary"],
)
def test_undecodable_files_are_named_with_the_byte_and_offset(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        configs.read_yaml_mapping(path, ConfigError)
    assert str(info.value) == f"{path}: {message}"


def test_a_huge_file_is_refused_without_reading_it_whole():
    with pytest.raises(ConfigError, match="larger than 4 MiB, not a config file"):
        configs.read_yaml_mapping("/dev/zero", ConfigError)


COMMANDS = [
    pytest.param(ember_app, ["corpus", "build"], id="corpus build"),
    pytest.param(ember_app, ["corpus", "tokenize"], id="corpus tokenize"),
    pytest.param(midtrain_app, ["train"], id="midtrain train"),
    pytest.param(midtrain_app, ["launch", "--dry-run"], id="midtrain launch"),
    pytest.param(midtrain_app, ["rl"], id="midtrain rl"),
    pytest.param(ember_app, ["rollouts", "etl"], id="rollouts etl"),
]


@pytest.mark.parametrize(("app", "command"), COMMANDS)
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"model:\n  tokenizer: \xff\xfe\n", "not UTF-8 text (byte 0xff at offset 20)"),
        (bytes(range(256)), "not UTF-8 text (byte 0x80 at offset 128)"),
        (b"model: {}\n\x00\x01", "not a text file (byte 0x00 at offset 10)"),
    ],
    ids=["latin-1", "binary", "nul"],
)
def test_every_tool_refuses_a_non_utf8_config_with_exit_2_and_one_line(tmp_path, app, command, content, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    result = CliRunner(env={"COLUMNS": "1000"}).invoke(app, [*command, str(path)])  # wide: rich would wrap the path
    lines = [line for line in result.output.splitlines() if line.strip() and "apitools" not in line]  # a Beam import warning
    assert result.exit_code == 2, result.output
    assert lines == [f"{path}: {message}"], result.output
