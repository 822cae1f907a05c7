"""HTML -> text in a child process: main content, charsets, and failures as (reason, detail) - the time
limit enforced on a page resiliparse needs seconds for, with the next page served by a fresh child."""

from __future__ import annotations

import time

import pytest

from ember.pipelines.web.html_text import ExtractOptions, HtmlExtractor, extract, thread_extractor

from tests.pipelines.web_support import PROSE, page



def nested(levels: int) -> bytes:
    """Unclosed, nested elements: main-content extraction grows faster than quadratically with the depth
    (measured here: 1,000 levels ~0.9 s, 4,000 ~3.6 s, 10,000 ~23 s, 30,000 ~370 s)."""
    return b"<html><body>" + b"<div><p>word " * levels + b"</body></html>"


@pytest.fixture(scope="module")
def extractor():
    with HtmlExtractor(ExtractOptions(time_limit_s=30, max_bytes=50_000_000)) as ex:
        yield ex


def test_main_content_without_navigation_and_footer(extractor: HtmlExtractor) -> None:
    text, reason, _ = extractor.extract(page("River", [PROSE["en"], PROSE["de"]]))
    assert reason == "" and PROSE["en"] in text and PROSE["de"] in text
    assert "About us" not in text and "All rights reserved" not in text
    everything, _, _ = extract(page("River", [PROSE["en"]]), None, main_content=False)
    assert "About us" in everything, "main_content: false keeps the navigation"


def test_charset_declared_detected_or_undecodable(extractor: HtmlExtractor) -> None:
    latin = page("Fluss", [PROSE["de"]], charset="iso-8859-1")
    assert PROSE["de"] in extractor.extract(latin, "iso-8859-1")[0]
    assert PROSE["de"] in extractor.extract(latin, None)[0], "from the page's <meta charset>"
    assert PROSE["de"] in extractor.extract(latin, "no-such-charset")[0], "an unknown declared charset: detected"
    text, reason, detail = extractor.extract(b"\x81\x8d\x8f\x90\x9d", "utf-8")
    assert (text, reason) == ("", "html_decode_error") and "cp1252 failed too" in detail


def test_empty_and_too_large_pages_are_rejected_with_their_reason() -> None:
    with HtmlExtractor(ExtractOptions(time_limit_s=30, max_bytes=1000)) as small:
        assert small.extract(b"<html><script>var x = 1;</script></html>")[1] == "html_empty"
        _, reason, detail = small.extract(b"<p>" + b"x" * 2000 + b"</p>")
        assert reason == "html_too_large" and detail == "2,007 bytes of HTML > html.max_bytes 1,000"


def test_the_time_limit_kills_a_slow_extraction_and_the_next_page_still_extracts() -> None:
    with HtmlExtractor(ExtractOptions(time_limit_s=0.05, max_bytes=50_000_000)) as limited:
        assert limited.extract(b"<p>warm up</p>")[0] == "warm up"
        started = time.perf_counter()
        text, reason, detail = limited.extract(nested(30_000))
        took = time.perf_counter() - started
        assert (text, reason) == ("", "html_timeout") and "html.time_limit_s 0.05s" in detail
        assert took < 1.0, f"the limit returned after {took:.2f}s, not after the extraction finished"
        assert limited.extract(b"<main><p>after the timeout</p></main>")[0] == "after the timeout"


def test_a_shallower_page_of_the_same_kind_extracts_in_full(extractor: HtmlExtractor) -> None:
    """The control of the test above: such a page is slow, not broken."""
    text, reason, _ = extractor.extract(nested(500))
    assert reason == "" and text.count("word") == 500


def test_each_thread_keeps_one_extractor_per_settings() -> None:
    options = ExtractOptions(time_limit_s=5, max_bytes=1000)
    assert thread_extractor(options) is thread_extractor(options)
    assert thread_extractor(options) is not thread_extractor(ExtractOptions(time_limit_s=5, max_bytes=1001))


def test_a_page_never_collected_does_not_answer_for_the_next() -> None:
    """A reader abandoned between submit and collect leaves an answer in the pipe: the next page restarts the child."""
    with HtmlExtractor(ExtractOptions(time_limit_s=30, max_bytes=1_000_000)) as ex:
        ex.submit(b"<main><p>first page</p></main>")
        assert ex.extract(b"<main><p>second page</p></main>")[0] == "second page"
        submitted = ex.submit(b"<main><p>third page</p></main>")
        assert ex.collect(submitted)[0] == "third page"
