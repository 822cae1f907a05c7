"""What every config file gets alike (ember.configs): `${VAR}` expansion of parsed values, and a file that is
not UTF-8 text, or an alias bomb, refused as a config error by every tool, with exit code 2 and one line, never
a traceback; and no error that shows a value from the environment or a secret field."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ember import configs
from ember.cli import app as ember_app
from ember.configs import ConfigError, CorpusConfigError, MidtrainConfigError
from ember.midtrain.cli import app as midtrain_app
from ember.midtrain.config import MidtrainConfig, load_config as load_midtrain
from ember.pipelines.corpus.config import CorpusConfig, load_config as load_corpus
from ember.rollouts.config import EtlConfig
from tests.peak_memory import run_with_peak_rss

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


def test_an_expanded_value_is_an_ordinary_string_to_yaml_json_and_pickle(monkeypatch):
    monkeypatch.setenv("EMBER_TEST_DATA", "/data")
    data = configs.parse_yaml_mapping("a: ['${EMBER_TEST_DATA}/x']\n", "c.yaml", ConfigError)
    assert isinstance(data["a"][0], configs.Expanded)  # what lets an error name the variable instead
    assert yaml.safe_load(yaml.safe_dump(data)) == yaml.safe_load(yaml.dump(data)) == {"a": ["/data/x"]}
    assert json.dumps(data) == '{"a": ["/data/x"]}'
    assert pickle.loads(pickle.dumps(data))["a"][0].written == "${EMBER_TEST_DATA}/x"


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


def _doubling(levels: int) -> str:
    """YAML whose last list holds 2**levels leaves through aliases of aliases, in `levels` lines."""
    lines = ["l0: &l0 ['${EMBER_TEST_LEAF}', '${EMBER_TEST_LEAF}']"]
    return "\n".join(lines + [f"l{i}: &l{i} [*l{i - 1}, *l{i - 1}]" for i in range(1, levels)])


def test_aliases_below_the_bound_are_expanded_once_and_stay_shared(monkeypatch):
    monkeypatch.setenv("EMBER_TEST_LEAF", "leaf")
    data = configs.parse_yaml_mapping(_doubling(16), "shared.yaml", ConfigError)  # 65,536 leaves written out
    node = data["l15"]
    for _ in range(15):
        assert node[0] is node[1]
        node = node[1]
    assert node == ["leaf", "leaf"]


def test_an_alias_bomb_is_refused_by_its_size_written_out_without_writing_it(monkeypatch):
    monkeypatch.setenv("EMBER_TEST_LEAF", "leaf")
    with pytest.raises(ConfigError) as info:
        configs.parse_yaml_mapping(_doubling(40), "bomb.yaml", ConfigError)  # 2^40 leaves if written out
    assert str(info.value) == (
        "bomb.yaml: (top level): over 16 MiB with its YAML aliases and ${VAR}s written out; "
        "a config is written by hand, this is an alias bomb or a data file"
    )


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
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert lines == [f"{path}: {message}"], result.output


RL = yaml.safe_load((REPO / "ember/midtrain/examples/rl_tiny_cpu.yaml").read_text())
CORPUS = {"sources": [{"name": "web", "kind": "web", "inputs": ["in/*.jsonl"]}], "output": {"directory": "out"}}
TOKENIZE = {
    "output_dir": "out",
    "tokenizer": {"kind": "huggingface", "path": "tokenizer.json", "eos_token": "<|endoftext|>"},
    "sources": [{"name": "code", "path": "code/*.parquet"}],
}
CL100K = {"name": "cl100k_base"}
ETL = {"kafka": {"topic_prefix": "t", "group_id": "g"}, "filters": {"vocab_size": 1000}}


def _merge(base: dict, **sections: dict) -> dict:
    """`base` with some keys of some sections replaced (a section that is not a mapping is replaced whole)."""
    return {**base, **{k: {**base[k], **v} if isinstance(base.get(k), dict) else v for k, v in sections.items()}}


def _problems(app, command: list[str], path: Path, env: dict[str, str] | None = None) -> list[str]:
    """The error lines a command prints for the config at `path` (exit code 2, one error)."""
    result = CliRunner(env={"COLUMNS": "1000", **(env or {})}).invoke(app, [*command, str(path)])
    assert result.exit_code == 2, result.output
    head, *lines = [line for line in result.output.splitlines() if line.strip()]
    assert head == f"{path} is invalid:", result.output
    return [line.strip() for line in lines]


# Each config holds independent mistakes in several sections, two of them found by one validator; the old
# loader stopped each validator at its first problem and left the tokenizer's for a later run.
ALL_AT_ONCE = [
    pytest.param(
        ember_app, ["corpus", "build"],
        _merge(
            CORPUS,
            sources=[{**CORPUS["sources"][0], "weight": -1}],
            filters={"code": {"min_chars": 50, "max_chars": 10}},
            dedup={"bands": 0},
            output={"rows_per_shard": 0},
            tokenize={"tokenizer": {"kind": "tiktoken", "path": "cl100k_base.tiktoken", "revision": "v1"}},
        ),
        [
            "sources.0.weight: Input should be greater than or equal to 0 (got -1)",
            "filters.code: min_chars (50) is larger than max_chars (10)",
            "dedup.bands: Input should be greater than or equal to 1 (got 0)",
            "output.rows_per_shard: Input should be greater than or equal to 1 (got 0)",
            "tokenize.tokenizer.path: a .tiktoken file holds only the BPE ranks",
            "tokenize.tokenizer.revision: applies to a Hugging Face repo id given as tokenizer.name only",
        ],
        id="corpus build",
    ),
    pytest.param(
        ember_app, ["corpus", "tokenize"],
        _merge(TOKENIZE, seq_len=1, tokenizer={"pattern": "x", "special_tokens": {"a": 1}}, sources=[{"name": "a b", "path": "p"}]),
        [
            "seq_len: Input should be greater than or equal to 2 (got 1)",
            "tokenizer.pattern: no longer set by hand",
            "tokenizer.special_tokens: no longer set by hand",
            "sources.0.name: String should match pattern '^[A-Za-z0-9_.-]+$' (got 'a b')",
        ],
        id="corpus tokenize",
    ),
    pytest.param(
        midtrain_app, ["train"],
        _merge(
            MIDTRAIN,
            model={"hidden_size": 66, "num_query_groups": 3},
            moe={"router_topk": 8, "expert_bias": True},
            optimizer={"lr": -1},
            train={"global_batch_size": 15},
        ),
        [
            "model: hidden_size 66 is not divisible by num_attention_heads 4",
            "model: num_attention_heads 4 is not divisible by num_query_groups 3",
            "moe: router_topk 8 exceeds num_experts 4",
            "moe: expert_bias needs router_score_function: sigmoid",
            "optimizer.lr: Input should be greater than 0 (got -1)",
            "train: global_batch_size 15 is not a multiple of micro_batch_size 4",
        ],
        id="midtrain train",
    ),
    pytest.param(
        midtrain_app, ["rl"],
        _merge(RL, rollouts={"topic_prefix": ""}, rl={"alpha": 3.0, "initial_policy_version": 2**63 - 1}, moe={"router_topk": 9}),
        [
            "moe: router_topk 9 exceeds num_experts 4",
            "rollouts.topic_prefix: String should have at least 1 character (got '')",
            "rl: alpha 3.0 must be below beta 2.0",
            "rl: initial_policy_version + steps exceeds 9,223,372,036,854,775,807",
        ],
        id="midtrain rl",
    ),
    pytest.param(
        ember_app, ["rollouts", "etl"],
        _merge(ETL, kafka={"heartbeat_interval_ms": 5000}, groups={"size": 2, "quorum": 3}, batches={"min_fill": 2}),
        [
            "kafka: heartbeat_interval_ms (5000) must be at most a third of session_timeout_ms (10000)",
            "groups: quorum (3) cannot exceed size (2)",
            "batches.min_fill: Input should be less than or equal to 1 (got 2)",
        ],
        id="rollouts etl",
    ),
    pytest.param(
        ember_app, ["rollouts", "etl"],
        _merge(ETL, advantages={"estimator": "rloo"}, groups={"size": 1}, filters={"max_tokens": 100_000}),
        [
            "(top level): advantages.estimator=rloo needs groups.quorum (or size) >= 2",
            "(top level): filters.max_tokens (100000) exceeds batches.token_budget (65536)",
        ],
        id="rollouts etl across sections",
    ),
]


@pytest.mark.parametrize(("app", "command", "data", "expected"), ALL_AT_ONCE)
def test_one_load_reports_every_problem_of_the_file(tmp_path, app, command, data, expected):
    lines = _problems(app, command, _write(tmp_path / "bad.yaml", data))
    for needle in expected:
        assert any(line.startswith(needle) for line in lines), (needle, lines)


def test_a_validator_with_two_problems_reports_both_under_their_keys():
    with pytest.raises(ConfigError) as info:
        configs.validate(
            MidtrainConfig, {**MIDTRAIN, "parallel": {"expert": 3, "tensor": 3}}, "run.yaml", ConfigError
        )
    lines = str(info.value).splitlines()[1:]
    assert lines == [
        "  (top level): parallel.expert 3 does not divide moe.num_experts 4",
        "  (top level): parallel.tensor 3 does not divide model.num_attention_heads",
    ]


SECRET = "s3cr3t-do-not-echo"
TYPOS = [
    pytest.param(ember_app, ["corpus", "build"], _merge(CORPUS, dedup={"rows_per_bands": SECRET}),
                 "dedup.rows_per_bands: unknown key; did you mean rows_per_band?", id="corpus"),
    pytest.param(ember_app, ["corpus", "build"], _merge(CORPUS, sources=[{**CORPUS["sources"][0], "fileds": SECRET}]),
                 "sources.0.fileds: unknown key; did you mean fields?", id="corpus list item"),
    pytest.param(ember_app, ["corpus", "build"],
                 _merge(CORPUS, filters={"web": {"gopher_quality": {"params": {"max_doc_word": SECRET}}}}),
                 "filters.web.gopher_quality.params.max_doc_word: unknown key; did you mean max_doc_words?", id="corpus datatrove"),
    pytest.param(ember_app, ["corpus", "build"], _merge(CORPUS, tokenize={"tokenizer": {**CL100K, "eos_tokn": SECRET}}),
                 "tokenize.tokenizer.eos_tokn: unknown key; did you mean eos_token?", id="corpus tokenize section"),
    pytest.param(ember_app, ["corpus", "tokenize"], {**TOKENIZE, "sequences_per_shrad": SECRET},
                 "sequences_per_shrad: unknown key; did you mean sequences_per_shard?", id="tokenize"),
    pytest.param(midtrain_app, ["train"], _merge(MIDTRAIN, model={"num_atention_heads": SECRET}),
                 "model.num_atention_heads: unknown key; did you mean num_attention_heads?", id="midtrain"),
    pytest.param(midtrain_app, ["rl"], _merge(RL, rl={"clip_hihg": SECRET}),
                 "rl.clip_hihg: unknown key; did you mean clip_high?", id="rl"),
    pytest.param(midtrain_app, ["rl"], _merge(RL, rollouts={"security": {"sasl_mechansim": SECRET}}),
                 "rollouts.security.sasl_mechansim: unknown key; did you mean sasl_mechanism?", id="rl security"),
    pytest.param(ember_app, ["rollouts", "etl"], _merge(ETL, advantages={"length_penalty": {"max_tokens": 8, "cache_tokes": SECRET}}),
                 "advantages.length_penalty.cache_tokes: unknown key; did you mean cache_tokens?", id="etl"),
    pytest.param(ember_app, ["rollouts", "etl"], {**ETL, "kafak": {"topic_prefix": SECRET}},
                 "kafak: unknown key; did you mean kafka?", id="etl section"),
]


@pytest.mark.parametrize(("app", "command", "data", "expected"), TYPOS)
def test_a_misspelled_key_gets_the_closest_allowed_key_and_never_its_value(tmp_path, app, command, data, expected):
    lines = _problems(app, command, _write(tmp_path / "bad.yaml", data))
    assert any(line.startswith(expected) for line in lines), lines
    assert not any(SECRET in line for line in lines)


def test_a_key_like_no_allowed_one_gets_no_guess():
    with pytest.raises(ConfigError) as info:
        configs.validate(MidtrainConfig, _merge(MIDTRAIN, moe={"zzzz": 1}), "run.yaml", ConfigError)
    assert "  moe.zzzz: unknown key" in str(info.value).splitlines()


def test_a_cross_section_problem_is_named_by_the_section_it_is_about(tmp_path):
    lines = _problems(midtrain_app, ["rl"], _write(tmp_path / "bad.yaml", {**RL, "parallel": {"tensor": 2}}))
    assert lines == [
        "parallel: the RL step runs each batch share as one micro-batch through the whole model: tensor and pipeline "
        "must be 1 (data- and expert-parallel ranks are supported)"
    ]


PASSWORD = "kafkaPW-d0-n0t-echo-7f3e9a"
FROM_ENV = "${EMBER_KAFKA_SASL_PASSWORD}"
NOT_AN_INT = "Input should be a valid integer, unable to parse string as an integer"
NAME_PATTERN = "String should match pattern '^[A-Za-z_][A-Za-z0-9_]*$'"
# One failing field per tool, given the password through ${VAR}: pydantic's input echo printed it as (got 'kafkaPW-...').
LEAKS = [
    pytest.param(ember_app, ["corpus", "build"], _merge(CORPUS, dedup={"bands": FROM_ENV}), f"dedup.bands: {NOT_AN_INT}",
                 id="corpus build"),
    pytest.param(ember_app, ["corpus", "tokenize"], {**TOKENIZE, "seq_len": FROM_ENV}, f"seq_len: {NOT_AN_INT}",
                 id="corpus tokenize"),
    pytest.param(midtrain_app, ["train"], _merge(MIDTRAIN, optimizer={"lr": FROM_ENV}),
                 "optimizer.lr: Input should be a valid number, unable to parse string as a number", id="midtrain train"),
    pytest.param(midtrain_app, ["launch", "--dry-run"], _merge(MIDTRAIN, model={"normalization": FROM_ENV}),
                 "model.normalization: Input should be 'RMSNorm' or 'LayerNorm'", id="midtrain launch"),
    pytest.param(midtrain_app, ["rl"], _merge(RL, rollouts={"security": {"sasl_plain_password_env": FROM_ENV}}),
                 f"rollouts.security.sasl_plain_password_env: {NAME_PATTERN}", id="midtrain rl"),
    pytest.param(ember_app, ["rollouts", "etl"], _merge(ETL, kafka={"security": {"sasl_plain_password_env": FROM_ENV}}),
                 f"kafka.security.sasl_plain_password_env: {NAME_PATTERN}", id="rollouts etl"),
    pytest.param(ember_app, ["rollouts", "stats"], _merge(ETL, kafka={"session_timeout_ms": FROM_ENV}),
                 f"kafka.session_timeout_ms: {NOT_AN_INT}", id="rollouts stats"),
    pytest.param(ember_app, ["rollouts", "replay", "--to", "out"], _merge(ETL, batches={"token_budget": FROM_ENV}),
                 f"batches.token_budget: {NOT_AN_INT}", id="rollouts replay"),
]


@pytest.mark.parametrize(("app", "command", "data", "expected"), LEAKS)
def test_no_tool_echoes_a_value_from_the_environment_but_names_the_variable(tmp_path, app, command, data, expected):
    lines = _problems(app, command, _write(tmp_path / "bad.yaml", data), env={"EMBER_KAFKA_SASL_PASSWORD": PASSWORD})
    assert lines == [f"{expected} (got the value of {FROM_ENV})"]  # every line the command printed but the header


def _validate(model, text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        configs.validate(model, configs.parse_yaml_mapping(text, "c.yaml", ConfigError), "c.yaml", ConfigError)
    return str(info.value).splitlines()[1:]


def test_a_message_that_embeds_the_value_shows_it_as_written(monkeypatch):
    monkeypatch.setenv("EMBER_TEST_HOST", "kafka\\PW 'token'!")  # repr() would double the backslash
    monkeypatch.setenv("EMBER_TEST_SIZE", "66")
    lines = _validate(CorpusConfig, (
        "sources: [{name: w, kind: web, inputs: [a]}]\noutput: {directory: o}\n"
        "filters: {web: {url_blocklist: {domains: [ok.com, 'x.${EMBER_TEST_HOST}']}}}\n"
    ))
    assert lines == ['  filters.web.url_blocklist.domains: "x.${EMBER_TEST_HOST}" is not a domain name (expected e.g. example.com)']
    text = yaml.safe_dump(_merge(MIDTRAIN, model={"hidden_size": "${EMBER_TEST_SIZE}"}))
    assert _validate(MidtrainConfig, text) == ["  model: hidden_size ${EMBER_TEST_SIZE} is not divisible by num_attention_heads 4"]


@pytest.mark.parametrize(("password", "message"), [(PASSWORD, NAME_PATTERN), (73_019_558, "Input should be a valid string")])
def test_a_secret_field_never_shows_its_value_even_when_written_literally(password, message):
    lines = _validate(EtlConfig, yaml.safe_dump(_merge(ETL, kafka={"security": {"sasl_plain_password_env": password}})))
    assert lines == [f"  kafka.security.sasl_plain_password_env: {message} (got a secret, not shown)"]


def test_a_long_value_is_shown_cut_to_one_readable_line():
    lines = _validate(EtlConfig, yaml.safe_dump(_merge(ETL, kafka={"session_timeout_ms": "9" * 1_000 + "x"})))
    assert lines == [f"  kafka.session_timeout_ms: {NOT_AN_INT} (got '{'9' * 99}... (1,003 characters))"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: [1, 2\nb: 3", "not valid YAML: did not find expected ',' or ']' at line 2, column 2 "
                          "(while parsing a flow sequence at line 1, column 4)"),
        (f'a: 1\npassword: "{PASSWORD}\n', "not valid YAML: found unexpected end of stream at line 3, column 1 "
                                          "(while scanning a quoted scalar at line 2, column 11)"),
        ("a: 2026-13-45", "not valid YAML: month must be in 1..12"),
        ("a: " + "1" * 5000, "not valid YAML: Exceeds the limit (4300 digits) for integer string conversion"),
        ("a: &a [b, *a]", "a.1: a YAML alias refers to a node that contains it; a config cannot be recursive"),
    ],
    ids=["syntax", "no excerpt of the file", "bad date", "huge int", "recursive alias"],
)
def test_a_yaml_problem_is_one_line_without_an_excerpt_of_the_file(text, message):
    with pytest.raises(ConfigError) as info:
        configs.parse_yaml_mapping(text, "c.yaml", ConfigError)
    assert str(info.value).startswith(f"c.yaml: {message}")
    assert "\n" not in str(info.value) and PASSWORD not in str(info.value)


BOMB_LINE = "over 16 MiB with its YAML aliases and ${VAR}s written out; a config is written by hand, this is an alias bomb or a data file"


def _alias_bomb(path: Path, head: str, string_chars: int, references: int) -> Path:
    """`head` (YAML) plus a key `bomb:` whose list references one anchored string `references` times."""
    path.write_text(f"{head}bomb: [&s '{'x' * string_chars}', {', '.join(['*s'] * references)}]\n")
    return path


@pytest.mark.parametrize(("app", "command"), COMMANDS)
def test_every_tool_refuses_an_alias_bomb_with_exit_2_and_one_line(tmp_path, app, command):
    path = _alias_bomb(tmp_path / "bomb.yaml", "", 64 * 1024, 300)  # 19 MiB written out; before: "bomb: unknown key"
    result = CliRunner(env={"COLUMNS": "1000"}).invoke(app, [*command, str(path)])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [f"{path}: bomb: {BOMB_LINE}"]


def test_the_issue_alias_bomb_fails_at_once_in_bounded_memory(tmp_path):
    """Issue 26: one 1.5 MB string referenced 500,000 times in a 3.5 MB file passed validation, then the phase
    key's JSON took 4.2 GB and ended in a MemoryError traceback. The child runs under a CPU-time limit (the
    pure-Python parser alone took 100 s) and an address-space cap, so a regression fails instead of swapping."""
    config = _alias_bomb(tmp_path / "bomb.yaml", "sources: [{name: web, kind: web, inputs: [in/*.jsonl]}]\noutput: {directory: out}\n",
                         1_500_000, 500_000)
    assert 3_400_000 < config.stat().st_size < configs.MAX_CONFIG_BYTES

    with open(tmp_path / "out.txt", "w+") as out:
        child, peak = run_with_peak_rss(
            [sys.executable, "-m", "ember.cli", "corpus", "build", str(config)], tmp_path, stdout=out, cwd=tmp_path,
            env={**os.environ, "COLUMNS": "1000"}, limits={"RLIMIT_CPU": 60, "RLIMIT_AS": 3 * 2**30},
        )
        out.seek(0)
        output = out.read()
    assert child.returncode == 2, output
    assert output.splitlines() == [f"{config}: bomb: {BOMB_LINE}"]
    assert peak < 1 * 2**30, peak  # it needed over 4 GiB before
