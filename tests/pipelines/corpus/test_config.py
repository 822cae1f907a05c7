"""Config validation: every error names the key that is wrong and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.configs import CorpusConfigError
from ember.pipelines.corpus.config import check_inputs, load_config, parse_config

BASE = {"sources": [{"name": "web", "kind": "web", "inputs": ["in/*.jsonl"]}], "output": {"directory": "out"}}


def _error(data: dict) -> str:
    with pytest.raises(CorpusConfigError) as info:
        parse_config(data)
    return str(info.value)


def test_defaults_are_finewebs_minhash_setting() -> None:
    config = parse_config(BASE)
    assert (config.dedup.n_grams, config.dedup.bands, config.dedup.rows_per_band) == (5, 14, 8)
    assert config.dedup.threshold == pytest.approx(0.719, abs=1e-3)
    assert config.filters.web.validated_params("c4_quality") == {"filter_no_terminal_punct": False}


def test_unknown_key_is_named() -> None:
    message = _error({**BASE, "dedupe": {}})
    assert "dedupe: unknown key" in message


def test_bad_source_fields_are_named_by_index() -> None:
    source = {"name": "bad name", "kind": "books", "inputs": [], "format": "csv", "fields": {"metadata": {"author": "a"}}}
    message = _error({**BASE, "sources": [source]})
    for needle in ("sources.0.name", "sources.0.kind", "sources.0.inputs", "sources.0.format", "unknown metadata keys ['author']"):
        assert needle in message


def test_datatrove_filter_params_are_checked_against_datatrove_signatures() -> None:
    message = _error({**BASE, "filters": {"web": {"gopher_quality": {"params": {"min_doc_words": "many", "min_words": 3}}}}})
    assert "gopher_quality.params.min_doc_words: Input should be a valid integer" in message
    assert "filters.web.gopher_quality.params.min_words: unknown key; did you mean min_doc_words?" in message


def test_datatrove_params_get_datatrove_types() -> None:
    config = parse_config({**BASE, "filters": {"web": {"gopher_repetition": {"params": {"top_n_grams": [[2, 0.3]]}}}}})
    assert config.filters.web.validated_params("gopher_repetition") == {"top_n_grams": ((2, 0.3),)}


def test_repeated_sources_and_preferences_are_rejected() -> None:
    assert "repeated: ['web']" in _error({**BASE, "sources": BASE["sources"] * 2})
    assert "dedup.prefer" in _error({**BASE, "dedup": {"prefer": ["stars", "stars"]}})
    assert "filters.code" in _error({**BASE, "filters": {"code": {"min_chars": 10, "max_chars": 5}}})


def test_load_resolves_paths_against_the_file(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("sources: [{name: w, kind: web, inputs: ['d/*.jsonl', '/abs/x.jsonl']}]\noutput: {directory: o}\n")
    config = load_config(str(tmp_path / "c.yaml"))
    assert config.sources[0].inputs == [str(tmp_path / "d/*.jsonl"), "/abs/x.jsonl"]
    assert config.output.directory == str(tmp_path / "o")


def test_load_reports_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(CorpusConfigError, match="cannot read the config file"):
        load_config(str(tmp_path / "missing.yaml"))
    (tmp_path / "bad.yaml").write_text("sources: [unclosed\n")
    with pytest.raises(CorpusConfigError, match="not valid YAML"):
        load_config(str(tmp_path / "bad.yaml"))
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(CorpusConfigError, match="expected a mapping"):
        load_config(str(tmp_path / "list.yaml"))


def test_glob_matching_nothing_is_a_config_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("{}\n")
    config = parse_config({
        "sources": [{"name": "w", "kind": "web", "inputs": [str(tmp_path / "*.jsonl"), str(tmp_path / "none/*.jsonl")]}],
        "output": {"directory": str(tmp_path / "out")},
    })
    with pytest.raises(CorpusConfigError) as info:
        check_inputs(config)
    assert f"sources.0.inputs.1: '{tmp_path}/none/*.jsonl' matches no file" in str(info.value)
    assert "inputs.0" not in str(info.value)


def test_an_input_from_a_variable_is_named_as_written_never_by_its_value(tmp_path: Path, monkeypatch) -> None:
    """The input checks run after validation, on plain strings: the config remembers what `${VAR}` gave."""
    monkeypatch.setenv("EMBER_TEST_BUCKET_TOKEN", "tok-d0-n0t-echo-51c2")
    (tmp_path / "c.yaml").write_text(
        "sources: [{name: w, kind: web, inputs: ['${EMBER_TEST_BUCKET_TOKEN}/*.jsonl']}]\noutput: {directory: out}\n"
    )
    with pytest.raises(CorpusConfigError) as info:
        check_inputs(load_config(str(tmp_path / "c.yaml")))
    assert str(info.value).splitlines() == [
        "inputs are unusable:", f"  sources.0.inputs.0: '{tmp_path}/${{EMBER_TEST_BUCKET_TOKEN}}/*.jsonl' matches no file"
    ]


def test_example_config_is_valid() -> None:
    example = Path(__file__).resolve().parents[3] / "ember/pipelines/examples/corpus.yaml"
    config = load_config(str(example))
    assert [s.name for s in config.sources] == ["web", "code"]
    assert config.dedup.prefer == ["permissive_license", "stars"]


def test_dedup_bands_of_a_million_are_refused_at_load_with_the_bound() -> None:
    # Was: accepted, then the build failed late trying to allocate 7.28 TiB for the signatures.
    message = _error({**BASE, "dedup": {"bands": 10**6}})
    assert "dedup.bands: at most 1,024: each band is one shuffled LSH key per document (got 1000000)" in message


def test_hash_count_is_refused_with_its_memory_estimate() -> None:
    message = _error({**BASE, "dedup": {"bands": 1024, "rows_per_band": 256}})
    assert "bands x rows_per_band = 262,144 hashes need about 4.0 GiB per worker" in message
    assert "at most 1.0 GiB" in message
    assert parse_config({**BASE, "dedup": {"bands": 1024, "rows_per_band": 256, "near": False}}).dedup.num_hashes == 262_144
    assert parse_config({**BASE, "dedup": {"bands": 128, "rows_per_band": 64}}).dedup.num_hashes == 8192


@pytest.mark.parametrize(
    ("section", "values", "expected"),
    [
        ("dedup", {"n_grams": 1000}, "dedup.n_grams: at most 256"),
        ("dedup", {"rows_per_band": 257}, "dedup.rows_per_band: at most 256"),
        ("output", {"directory": "o", "rows_per_shard": 10**7}, "output.rows_per_shard: at most 1,000,000"),
        ("tokenize", {"tokenizer": {"kind": "huggingface", "path": "t.json", "eos_token": "e"}, "seq_len": 2**20, "rows_per_batch": 4096},
         "tokenize: rows_per_batch x seq_len = 4,294,967,296 tokens in one record batch"),
    ],
)
def test_sizes_have_upper_bounds(section, values, expected) -> None:
    assert expected in _error({**BASE, section: values})


def test_non_finite_weights_are_refused() -> None:
    message = _error({**BASE, "sources": [{**BASE["sources"][0], "weight": float("inf")}]})
    assert "sources.0.weight: Input should be a finite number" in message
