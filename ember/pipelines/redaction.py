"""Secrets and PII replaced by typed placeholders, with a count per detector type.

Pure: `redact(text, config)` returns the new text and the counts, so a document redacts the same way
on every worker and every rerun. High-signal formats (PEM blocks, AWS/GitHub/Slack tokens) are matched
exactly; generic `*_KEY = "..."` style assignments need a high-entropy value so ordinary code survives.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections import Counter

from ember.pipelines.corpus_config import Redaction

PLACEHOLDERS = {
    "email": "<EMAIL>",
    "ip_address": "<IP_ADDRESS>",
    "aws_access_key": "<KEY>",
    "github_token": "<KEY>",
    "slack_token": "<KEY>",
    "private_key": "<PRIVATE_KEY>",
    "secret": "<KEY>",
    "password": "<PASSWORD>",
}

_PRIVATE_KEY = re.compile(
    r"-----BEGIN (?P<kind>[A-Z0-9 ]*)PRIVATE KEY-----.*?-----END (?P=kind)PRIVATE KEY-----", re.DOTALL
)
_TOKENS = {
    "aws_access_key": re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA)[A-Z0-9]{16}(?![A-Z0-9])"),
    "github_token": re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})\b"),
    "slack_token": re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,250}\b"),
}
# NAME = "value" / NAME: value / "name": "value"; NAME ends in a secret-ish word.
_ASSIGNMENT = re.compile(
    r"(?<![A-Za-z0-9_])(?P<name>(?:[A-Za-z_][A-Za-z0-9_.-]*?)?(?P<word>password|passwd|passphrase|pwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key|key)[A-Za-z0-9_]*)"
    r"(?P<sep>[\"']?\s*(?::=|=>|=|:)\s*)"
    r"(?:(?P<quote>[\"'`])(?P<qvalue>[^\"'`\n]+)(?P=quote)|(?P<value>[^\s\"'`,;)\]}]+))",
    re.IGNORECASE,
)
_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}(?![\w-])")
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.])")
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:.])")
# Unquoted values that are code, not secrets: attribute chains, calls, env lookups, templating.
_CODE_VALUE = re.compile(r"^(?:[A-Za-z_][\w]*\.[\w.]*|[\w.]*\(.*|\$\{.*|\{\{.*|%\(.*|os\.environ.*|none|null|true|false|nil)$", re.IGNORECASE)


def shannon_entropy(value: str) -> float:
    """Bits per character of `value`'s own character distribution."""
    if not value:
        return 0.0
    counts = Counter(value)
    n = len(value)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def _looks_like_secret(word: str, value: str, quoted: bool, config: Redaction) -> str | None:
    """The detector type an assigned value triggers, or None for ordinary code and placeholders."""
    if value.startswith("<") and value.endswith(">"):
        return None
    if not quoted and _CODE_VALUE.match(value):
        return None
    if len(set(value)) <= 2:  # "xxxxxxxx", "********"
        return None
    if word.lower() in ("password", "passwd", "passphrase", "pwd"):
        return "password" if len(value) >= config.min_password_length else None
    if len(value) >= config.min_secret_length and shannon_entropy(value) >= config.min_secret_entropy:
        return "secret"
    return None


_GLOBAL_UNICAST_V6 = ipaddress.ip_network("2000::/3")
_VERSION_BEFORE = re.compile(r"\b(?:version|ver|v)[\s:=]*$", re.IGNORECASE)


def _global_ip(candidate: str, before: str) -> bool:
    """Public addresses only; private/loopback ones are not PII, and 'version 1.2.3.4' is not an address."""
    try:
        address = ipaddress.ip_address(candidate)
    except ValueError:
        return False
    if address.version == 6:
        return address in _GLOBAL_UNICAST_V6 and address.is_global
    return address.is_global and not _VERSION_BEFORE.search(before)


def redact(text: str, config: Redaction) -> tuple[str, dict[str, int]]:
    """`text` with every enabled detector's hits replaced, and hits per type (types with no hit omitted)."""
    counts: Counter[str] = Counter()
    enabled = set(config.types)

    def sub(kind: str, pattern: re.Pattern[str], value: str) -> str:
        def replace(match: re.Match[str]) -> str:
            counts[kind] += 1
            return PLACEHOLDERS[kind]

        return pattern.sub(replace, value)

    if "private_key" in enabled:
        text = sub("private_key", _PRIVATE_KEY, text)
    for kind, pattern in _TOKENS.items():
        if kind in enabled:
            text = sub(kind, pattern, text)
    if enabled & {"secret", "password"}:

        def assignment(match: re.Match[str]) -> str:
            quoted = match.group("qvalue") is not None
            value = match.group("qvalue") if quoted else match.group("value")
            kind = _looks_like_secret(match.group("word"), value, quoted, config)
            if kind is None or kind not in enabled:
                return match.group(0)
            counts[kind] += 1
            start, end = match.span("qvalue" if quoted else "value")
            offset = match.start()
            whole = match.group(0)
            return whole[: start - offset] + PLACEHOLDERS[kind] + whole[end - offset :]

        text = _ASSIGNMENT.sub(assignment, text)
    if "email" in enabled:
        text = sub("email", _EMAIL, text)
    if "ip_address" in enabled:

        def ip(match: re.Match[str]) -> str:
            if not _global_ip(match.group(0), match.string[max(0, match.start() - 12) : match.start()]):
                return match.group(0)
            counts["ip_address"] += 1
            return PLACEHOLDERS["ip_address"]

        text = _IPV4.sub(ip, text)
        text = _IPV6.sub(ip, text)
    return text, dict(counts)
