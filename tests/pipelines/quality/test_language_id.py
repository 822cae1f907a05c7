"""Language ID with lingua on known sentences, the allow-list verdicts, their config checks, and the URL
block-list's subdomain matching."""

from __future__ import annotations

import pytest

from ember.configs import CorpusConfigError
from ember.pipelines.corpus.config import parse_config
from ember.pipelines.quality.language_id import DEFAULT_CANDIDATES, UNKNOWN, identifier, language_verdict
from ember.pipelines.web.blocklist import UrlBlocklist, normalize_domain, parse_domain_lines

from tests.pipelines.web_support import PROSE


@pytest.mark.parametrize("low_accuracy", [False, True], ids=["high", "low"])
def test_known_sentences_in_six_languages(low_accuracy: bool) -> None:
    detect = identifier(DEFAULT_CANDIDATES, low_accuracy, 2000)
    for code, text in PROSE.items():
        language, score = detect.identify(text)
        assert language == code and score > 0.9, (code, language, score)


def test_no_letters_is_unknown_and_only_the_first_max_chars_are_read() -> None:
    assert identifier(DEFAULT_CANDIDATES, False, 2000).identify("1234 5678 -- 42") == (UNKNOWN, 0.0)
    english_first = PROSE["en"] + " " + PROSE["de"] * 5
    assert identifier(DEFAULT_CANDIDATES, False, len(PROSE["en"])).identify(english_first)[0] == "en"
    assert identifier(DEFAULT_CANDIDATES, False, 10_000).identify(english_first)[0] == "de"


def test_candidates_restrict_what_can_be_found() -> None:
    assert identifier(("en", "fr"), False, 2000).identify(PROSE["es"])[0] in ("en", "fr")


def test_verdicts_of_the_allow_list() -> None:
    assert language_verdict("de", 0.99, None, 0.65) == ("", "")
    assert language_verdict("en", 0.99, ["en", "de"], 0.65) == ("", "")
    reason, detail = language_verdict("fr", 0.99, ["en", "de"], 0.65)
    assert reason == "language:fr" and "allows en, de" in detail
    reason, detail = language_verdict("en", 0.40, ["en"], 0.65)
    assert reason == "language:en" and "0.40 < filters.web.min_language_score 0.65" in detail
    assert language_verdict(UNKNOWN, 0.0, ["en"], 0.65)[0] == "language:unknown"


def _config(web: dict) -> dict:
    return {"sources": [{"name": "w", "kind": "web", "inputs": ["x"]}], "filters": {"web": web}, "output": {"directory": "o"}}


def test_language_settings_are_checked_at_the_edge() -> None:
    with pytest.raises(CorpusConfigError, match=r"\['xx'\] are not ISO 639-1 codes of a language lingua detects"):
        parse_config(_config({"language_id": {"candidates": ["en", "xx"]}}))
    with pytest.raises(CorpusConfigError, match=r"languages \['fr'\] are not among language_id.candidates"):
        parse_config(_config({"languages": ["en", "fr"], "language_id": {"candidates": ["en", "de"]}}))
    with pytest.raises(CorpusConfigError, match="languages needs language_id.enabled: true"):
        parse_config(_config({"languages": ["en"], "language_id": {"enabled": False}}))
    with pytest.raises(CorpusConfigError, match="min_language_score"):
        parse_config(_config({"min_language_score": 1.5}))
    with pytest.raises(CorpusConfigError, match="set by the build"):
        parse_config({"sources": [{"name": "w", "kind": "web", "inputs": ["x"],
                                   "fields": {"metadata": {"language_score": "score"}}}], "output": {"directory": "o"}})


def test_block_list_matches_the_domain_and_its_subdomains_only() -> None:
    blocklist = UrlBlocklist(["example.com", "ads.net"])
    assert blocklist.blocked_by("https://example.com/page") == "example.com"
    assert blocklist.blocked_by("http://user:pw@Shop.EU.Example.COM:8080/x?q=1") == "example.com"
    assert blocklist.blocked_by("https://notexample.com/") is None, "a label must match whole"
    assert blocklist.blocked_by("https://example.com.evil.org/") is None
    assert blocklist.blocked_by("https://tracker.ads.net") == "ads.net"
    assert blocklist.blocked_by(None) is None and blocklist.blocked_by("not a url") is None


def test_block_list_entries_and_files() -> None:
    assert normalize_domain(" *.Example.COM. ") == "example.com"
    assert normalize_domain("bücher.de") == "xn--bcher-kva.de"
    lines = ["# adult sites", "", "example.com  # trailing comment", ".ads.net"]
    assert parse_domain_lines(lines, "block.txt") == ["example.com", "ads.net"]
    with pytest.raises(ValueError, match=r"block.txt:2: 'http://x.org/path' is not a domain name"):
        parse_domain_lines(["ok.org", "http://x.org/path"], "block.txt")
    with pytest.raises(CorpusConfigError, match="is not a domain name"):
        parse_config(_config({"url_blocklist": {"domains": ["exa mple.com"]}}))
