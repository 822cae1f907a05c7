"""WARC archives and HTML pages the web-input tests write with warcio, and prose in several languages."""

from __future__ import annotations

import io
from dataclasses import dataclass

from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

PROSE = {
    "en": ("The river runs quietly through the old town, and in the evening the people walk along its banks "
           "to watch the boats come home. Children play near the water while their parents talk about the day."),
    "de": ("Der Fluss fließt ruhig durch die alte Stadt, und am Abend gehen die Leute an seinem Ufer spazieren, "
           "um die Boote heimkehren zu sehen. Die Kinder spielen am Wasser, während ihre Eltern über den Tag reden."),
    "fr": ("La rivière traverse tranquillement la vieille ville, et le soir les gens se promènent le long de ses "
           "rives pour regarder les bateaux rentrer. Les enfants jouent près de l'eau pendant que leurs parents parlent."),
    "es": ("El río atraviesa tranquilamente el casco antiguo, y por la tarde la gente pasea por sus orillas para "
           "ver volver los barcos. Los niños juegan cerca del agua mientras sus padres hablan del día."),
    "ru": ("Река спокойно течёт через старый город, и по вечерам люди гуляют вдоль её берегов, чтобы смотреть, "
           "как возвращаются лодки. Дети играют у воды, пока их родители разговаривают о прошедшем дне."),
    "ja": ("川は古い町の中を静かに流れ、夕方になると人々は船が帰ってくるのを見るために川岸を散歩します。"
           "子供たちは水辺で遊び、両親はその日の出来事について話しています。"),
}


def page(title: str, paragraphs: list[str], charset: str = "utf-8") -> bytes:
    """An HTML page with navigation and a footer around its main content."""
    body = "".join(f"<p>{p}</p>" for p in paragraphs)
    return (
        f'<!DOCTYPE html><html><head><meta charset="{charset}"><title>{title}</title></head><body>'
        f'<nav><a href="/">Home</a> | <a href="/about">About us</a> | <a href="/contact">Contact</a></nav>'
        f"<main><article><h1>{title}</h1>{body}</article></main>"
        f"<footer>Copyright 2024 Example Corp. All rights reserved.</footer></body></html>"
    ).encode(charset)


@dataclass(frozen=True)
class Record:
    """One WARC record to write: a response (with HTTP status and content type) or another record type."""

    url: str
    payload: bytes
    content_type: str = "text/html; charset=utf-8"
    status: str = "200 OK"
    rec_type: str = "response"


def warc_bytes(records: list[Record], gzip: bool) -> bytes:
    buffer = io.BytesIO()
    writer = WARCWriter(buffer, gzip=gzip)
    for r in records:
        if r.rec_type == "response":
            http = StatusAndHeaders(r.status, [("Content-Type", r.content_type)], protocol="HTTP/1.1")
            record = writer.create_warc_record(r.url, "response", payload=io.BytesIO(r.payload), http_headers=http)
        else:
            record = writer.create_warc_record(r.url, r.rec_type, payload=io.BytesIO(r.payload))
        writer.write_record(record)
    return buffer.getvalue()
