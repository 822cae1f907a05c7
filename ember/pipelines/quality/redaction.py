"""Secrets and PII replaced by typed placeholders, with a count per detector type.

Pure: `redact(text, config)` returns the new text and the counts, so a document redacts the same way
on every worker and every rerun. Values are replaced, never the identifiers around them: in
`password = "hunter2!"` only the literal becomes `<PASSWORD>`, and `password = lexer.get_token()` is code,
not a secret. High-signal formats (PEM blocks, JWTs, AWS/GitHub/Slack/vendor tokens, `user:pass@` in
URLs, `Authorization: Bearer ...`) are matched by shape; keyword assignments (`*_KEY`, `*_TOKEN`,
`*password*`, after detect-secrets' keyword detector) need a literal value of the right shape, and a
generic key or token also needs length, a digit and entropy, so ordinary code survives. Measured on a
labelled set by bench/bench_redaction.py (BENCHMARKS.md).

Time is linear in the text, whatever the text: `re` backtracks, and a pattern goes quadratic where a
failed try scans far and the next start rescans it (`sk-` x n, `%...%@`, `a.a.a.`..., PEM headers with no
END). So repeats are possessive where nothing after them could give a character back, an assignment or
an email starts only where a run of its characters starts, an OpenAI key's middle is bounded, a PEM body
stops at the next run of dashes, and the per-match decisions look a bounded distance around the match,
never to the line's start or end. tests/pipelines/redaction_adversarial.py holds hostile inputs
for every pattern; test_redaction.py holds their time at 1 MB to about 16x that at 64 KB.

Linear is not small: a document of megabytes still takes seconds. `redaction.time_limit_s` bounds one
document's CPU time, and the corpus build rejects an overrun as `redaction_timeout`. A regex match
cannot be stopped from Python outside the main thread (Beam runs DoFns on worker threads, and only the
main thread sees signals), so the limit is checked before each of the ~14 detector passes: a document
stops at most one pass past its limit, and a pass costs at most its text's length times the slowest
per-character cost (~3.5 us/byte on a line packed with public addresses; under 1 us/byte on every other
hostile input measured, BENCHMARKS.md).
CPU time of the thread, not wall time, keeps a loaded machine from rejecting documents, but a document
near the limit may land either side of it on a rerun: null turns the limit off for a build that must be
reproducible byte for byte.
"""

from __future__ import annotations

import ipaddress
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ember.pipelines.quality.settings import Redaction

PLACEHOLDERS = {
    "private_key": "<PRIVATE_KEY>",
    "jwt": "<KEY>",
    "aws_access_key": "<KEY>",
    "github_token": "<KEY>",
    "slack_token": "<KEY>",
    "api_token": "<KEY>",
    "bearer_token": "<KEY>",
    "url_password": "<PASSWORD>",
    "secret": "<KEY>",
    "password": "<PASSWORD>",
    "email": "<EMAIL>",
    "ip_address": "<IP_ADDRESS>",
}

_PRIVATE_KEY = re.compile(
    r"-----BEGIN (?P<kind>[A-Z0-9 ]*)PRIVATE KEY(?P<block>(?: BLOCK)?)-----"
    # the whole block: its body holds no `-----`, so a header without its END looks no further than the next run of dashes
    r"(?:(?:[^-]++|-(?!----))*+-*?-----END (?P=kind)PRIVATE KEY(?P=block)-----"
    r"|(?:(?:\s|\\n)++[A-Za-z0-9+/=]{16,}+)*+)",  # a block cut before its END line: the base64 lines that remain
)
_B64URL = r"[A-Za-z0-9_-]"
_JWT = re.compile(rf"(?<![A-Za-z0-9_-])eyJ{_B64URL}{{10,}}+\.{_B64URL}{{10,}}+\.{_B64URL}{{10,}}+")
_TOKENS = {
    "aws_access_key": re.compile(r"(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA)(?<![A-Z0-9].{4})[A-Z0-9]{16}(?![A-Z0-9])"),
    "github_token": re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})\b"),
    "slack_token": re.compile(
        r"\bxox[abposre]-[A-Za-z0-9-]{10,250}\b|https://hooks\.slack\.com/services/T[A-Z0-9]++/B[A-Z0-9]++/[A-Za-z0-9]{16,}"
    ),
    # Vendor formats with a fixed prefix (detect-secrets / gitleaks): Stripe, Google, OpenAI, GitLab, npm,
    # PyPI, SendGrid, Twilio, Hugging Face. An OpenAI key's `T3BlbkFJ` comes within 100 characters of its
    # `sk-` (20 in legacy keys, 58-82 in project, service-account and admin keys): unbounded, every `sk-`
    # of `sk-sk-sk-...` would rescan the rest of the run for it.
    "api_token": re.compile(
        r"\b(?:[rs]k_(?:live|test)_[0-9A-Za-z]{24,99}|glpat-[0-9A-Za-z_-]{20,}+|npm_[A-Za-z0-9]{36}|hf_[A-Za-z0-9]{34,40}"
        r"|SK[0-9a-f]{32}|pypi-AgEIcHlwaS5vcmc[A-Za-z0-9_-]{50,}+|SG\.[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]{43})(?![A-Za-z0-9_-])"
        r"|\bsk-(?:(?:proj-)?[A-Za-z0-9_-]{20,100}T3BlbkFJ[A-Za-z0-9_-]{20,}+|proj-[A-Za-z0-9_-]{40,}+)"
        r"|\bAIza[0-9A-Za-z_-]{35}(?![A-Za-z0-9_-])"
    ),
}
# `Authorization: Bearer <token>`, `Authorization: Basic <base64>`, `Authorization: token <token>`, `bearer <token>`.
_BEARER = re.compile(
    r"(?i)(?:\bbearer|\bauthorization[\"']?[ \t]*+[:=][ \t]*+[\"']?(?:basic|token|digest))[ \t]++"
    r"(?P<value>[A-Za-z0-9._~+/-]{12,}+=*+)"
)
# scheme://user:password@host: only the password is replaced.
_URL_PASSWORD = re.compile(r"(?i)\b[a-z][a-z0-9+.-]{1,20}+://[^\s:/?#@\"'`<>]*+:(?P<value>[^\s/@\"'`<>]++)@(?=[\w\[])")
# ?api_key=...&token=...: the parameter's value, classified like an assignment of that name.
_QUERY_PARAM = re.compile(r"(?<=[?&])(?P<name>[A-Za-z][A-Za-z0-9_.-]*+)=(?P<value>[^&#\s\"'`<>]++)")
# NAME = "value", NAME: value, "name": "value", d['name'] = 'value', --name=value; one line, no `==`.
# A name starts at a letter or `_` after a `.` or `-` or at the start of a run of name characters, and runs to
# the run's end; the match starts at the run's start and skips (possessively) what cannot start a name
# (`--`, `1a.`, `$a.`), so `a.a.a.`... is tried once, not once per `.` (each try would rescan the run).
# The leading lookahead turns away a position that starts no run in one test.
_ASSIGNMENT = re.compile(
    r"(?=[A-Za-z0-9_.-])(?<![A-Za-z0-9_.-])(?:[.-]|[0-9][A-Za-z0-9_]*+|(?<=\$)[A-Za-z_][A-Za-z0-9_]*+)*+"
    r"(?P<name>[A-Za-z_][A-Za-z0-9_.-]*+)(?:[\"'`]?\])?[\"'`]?"
    r"(?P<sep>[ \t]*+(?::=|=>|(?<![=!<>])=(?!=)|:(?!:))[ \t]*+)"
    r"(?:[bBrRuU]?@?(?:\"(?P<dq>[^\"\n]*)\"|'(?P<sq>[^'\n]*)'|`(?P<bq>[^`\n]*)`)|(?P<value>[^\s\"'`,;()\[\]{}<>]+))"
)
# Passwords by position, not by name: SQL `PASSWORD 'x'` / `IDENTIFIED BY 'x'`, HTTP basic auth tuples
# (`auth=("user", "x")`), libpq's `password=x` inside a connection string.
_PASSWORD_SHAPES = re.compile(
    r"(?i)\b(?:password|identified\s++by)\s++'(?P<value>[^'\n]++)'"
    r"|\bauth\b\s*+=\s*+\(\s*+[\"'][^\"'\n]++[\"']\s*+,\s*+[\"'](?P<tuple>[^\"'\n]++)[\"']\s*+\)"
)
# The local part starts where a run of its characters starts (`%%%...@` is tried once, not from every `%`).
_EMAIL = re.compile(r"(?<![\w.%+-])[A-Za-z0-9._%+-]++@[A-Za-z0-9-]++(?:\.[A-Za-z0-9-]++)*\.[A-Za-z]{2,}(?![\w-])")
# Not part of a longer dotted number (1.2.3.4.5, 7.1.1.1.2) nor of a word; a sentence's full stop may follow.
_IPV4 = re.compile(r"\d(?<![\w.-]\d)\d{0,2}\.(?:\d{1,3}\.){2}\d{1,3}(?![\w-])(?!\.\d)")
_IPV6 = re.compile(
    r"[0-9A-Fa-f:](?<![\w:.][0-9A-Fa-f:])(?:(?<=:)|[0-9A-Fa-f]{0,3}:)(?:[0-9A-Fa-f]{0,4}:){1,6}[0-9A-Fa-f]{0,4}(?![\w:])(?!\.\w)"
)

# Literal substrings without which a detector cannot match: a text holding none of them skips that
# regex (`in` is a fast scan; most documents hold no PEM block, JWT, URL or vendor prefix).
_TRIGGERS: dict[re.Pattern[str], tuple[str, ...]] = {
    _PRIVATE_KEY: ("PRIVATE KEY",),
    _JWT: ("eyJ",),
    _TOKENS["aws_access_key"]: ("AKIA", "ASIA", "AGPA", "AIDA", "AROA", "ANPA", "ANVA"),
    _TOKENS["github_token"]: ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
    _TOKENS["slack_token"]: ("xox", "hooks.slack.com"),
    _TOKENS["api_token"]: ("k_live_", "k_test_", "glpat-", "npm_", "hf_", "SK", "sk-", "pypi-", "SG.", "AIza"),
    _URL_PASSWORD: ("://",),
    _QUERY_PARAM: ("?", "&"),
    _EMAIL: ("@",),
}
_LOWER_TRIGGERS: dict[re.Pattern[str], tuple[str, ...]] = {
    _BEARER: ("bearer", "authorization"),
    _PASSWORD_SHAPES: ("password", "identified", "auth"),
}

# Name words: a password, or a generic secret (token, key, ...), after detect-secrets' keyword DENYLIST.
_NAME_PARTS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")
_PASSWORD_WORDS = frozenset({"password", "passwd", "passphrase", "pwd", "pass", "passwort", "contrasena", "contraseña"})
_SECRET_WORDS = frozenset({"secret", "secrets", "token", "apikey", "secretkey", "privatekey", "accesskey", "authkey", "credential", "credentials"})
# A last name part that makes the name about the secret, not the secret itself (password_prompt, TOKEN_URL).
_ABOUT_WORDS = frozenset(
    "prompt field fields file files path dir name names label hint length len min max size count policy regex pattern "
    "url uri endpoint type types kind env var header param params arg args input required help message msg text error "
    "expiry expires expiration ttl id format fmt prefix suffix style class mode method hash hashed digest enabled reset "
    "changed validator check timeout index idx offset attr attribute char chars column col provider manager store "
    "storage reader loader getter setter callback handler factory cls".split()
)
# Values that are never secrets: constants, types, well-known dummies (detect-secrets' FALSE_POSITIVES).
_DUMMY_VALUES = frozenset(
    "none null nil undefined true false yes no on off str string bytes int bool float any object required optional "
    "password passwd pass pwd secret token key apikey api_key redacted dummy example test todo xxx changeit "
    "your_password your-password yourpassword mypassword your_token your_api_key placeholder prompt".split()
)
# Templated or indirect values: ${X}, {{x}}, %(x)s, %s, {0}, $X, $(cmd), <placeholder>, !vault, os.environ[...].
_TEMPLATED = re.compile(r"\$\{|\{\{|%\(|%[sd]|\{\w*\}|^\$\(?\w|^<.*>$|^[!|>&*]|^os\.environ|process\.env|getenv")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_TYPE_NAME = re.compile(r"(?:[A-Z][a-z]+)+")
_PATH_VALUE = re.compile(r"^(?:~?/|\.\.?/|[A-Za-z]:\\)|://")
# Nothing but blanks or a comment after a value, to the end of its line: looked at from the value's end,
# never scanning the comment (a line of `pwd=x #pwd=x #...` would rescan it for every assignment).
_LINE_REST_IS_EMPTY = re.compile(r"[ \t\r]*+(?:#|//|--|\n|\Z)")

# Dotted numbers named by the words before them are versions and section numbers, not addresses.
# Each branch starts at a letter, `§`, `.` or a comparison sign: the lookahead skips every other start at once.
_NUMBERED_BEFORE = re.compile(
    r"(?i)(?=[a-z§.~>=<!^])(?:\b(?:v|ver|version|versions|release|rel|build|revision|rev|section|sections|sec|sect|chapter|clause|para|"
    r"paragraph|item|step|table|figure|fig|appendix|spec|specs|specification|numbered|rfc(?:\s*\d+)?|§)\.?[\s\"'(\[:=#,-]*$"
    # a requirement pin (`numpy==1.26.4.1`, `pkg[extra]>=2.0.0.1`): a version whatever the package is called;
    # a bare constraint (`>=1.2.3.4`, `~> 1.2.3.4`, `^1.2.3.4`) compares versions, never addresses
    r"|[A-Za-z][\w.-]*+(?:\[[\w,.-]+\])?\s*==\s*$|(?:~=|>=|<=|!=|===|~>|\^)\s*$"
    # a language, runtime, library or OS named just before (`IronPython 2.7.4.0`, `zlib 1.3.0.1`)
    r"|(?<![\w.-])(?:python|ironpython|jython|pypy|cpython|micropython|java|jdk|jre|openjdk|dotnet|\.net|mono|perl|"
    r"ruby|php|golang|rustc|gcc|clang|llvm|msvc|openssl|libressl|boringssl|zlib|sqlite3?|numpy|torch|cuda|cudnn|"
    r"windows|macos|ubuntu|debian|centos|rhel|fedora|android|kernel|chrome|chromium|firefox|safari|electron)[ \t]+$)"
)
# The identifier a value is assigned or passed to (`__version__ = '`, `AssemblyVersion("`, `"app_ver": "`,
# `version: str = "`): its name parts say whether the value is a version (and not, as in `VERSION_SERVER_IP`,
# an address).
_NAME_BEFORE = re.compile(r"(?<![A-Za-z0-9_])[A-Za-z_][A-Za-z0-9_]*(?=(?:[ \t]*:[ \t]*[\w.\[\]]+[ \t]*(?==))?[^\w\n]{0,6}$)")
_VERSION_WORDS = frozenset({"version", "versions", "ver", "vers", "vsn", "release", "revision"})
_ADDRESS_WORDS = frozenset(
    "ip ips ipv4 addr address addresses host hosts hostname peer remote client gateway gw dns nameserver proxy endpoint".split()
)
# A dotted number just before, joined by a bracket, an arrow or a list or range word: `2.7.4 (2.7.4.0)`, `v1.2.3.4 -> 1.2.3.5`.
_DOTTED_BEFORE = re.compile(
    r"(?<![\w.])(?P<v>[vV]?)(?P<number>\d++(?:\.\d++)++)"
    r"(?=[ \t]*(?:[(\[,/\u2013\u2192-]|->|(?:to|through|thru|and|or)\b)?[ \t\"'(\[]*$)"
)
# A section heading: `7.1.1.1.  Access Token Request` alone at a line start (RFC text), or after `#`s (Markdown).
_HEADING_BEFORE = re.compile(r"[ \t]*")
_HEADING_AFTER = re.compile(r"^\.[ \t]+[A-Z]")
_MARKDOWN_HEADING = re.compile(r"[ \t]*#{1,6}[ \t]+")
# ... and so are the ones followed by "of RFC ...".
_NUMBERED_AFTER = re.compile(r"(?i)^[\s\"')\],]*(?:of\s+(?:rfc|the\s+spec|section|chapter)|in\s+rfc)")
# A `/24` makes an address a network, `.in-addr.arpa` a DNS name.
_NETWORK_AFTER = re.compile(r"/\d{1,3}\b|\.in-addr\.arpa")
# Addresses that identify no one: private, loopback, link-local, CGNAT, multicast and reserved (RFC 6890),
# as (first, last) integers per IP version: a few comparisons per candidate, not a network object's.
_NOT_PERSONAL: dict[int, tuple[tuple[int, int], ...]] = {
    version: tuple(
        (int(n.network_address), int(n.broadcast_address))
        for n in map(ipaddress.ip_network, (
            "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
            "192.168.0.0/16", "224.0.0.0/3", "::/127", "fe80::/10", "fc00::/7", "ff00::/8",
        ))
        if n.version == version
    )
    for version in (4, 6)
}
_GLOBAL_UNICAST_V6 = ipaddress.ip_network("2000::/3")


def shannon_entropy(value: str) -> float:
    """Bits per character of `value`'s own character distribution."""
    if not value:
        return 0.0
    counts = Counter(value)
    n = len(value)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def name_kind(name: str) -> str | None:
    """'password' or 'secret' when an assigned name says its value is one (db_password, STRIPE_KEY, apiToken)."""
    parts = [p.lower() for p in _NAME_PARTS.findall(name)]
    if not parts or parts[-1] in _ABOUT_WORDS:
        return None
    if any(p in _PASSWORD_WORDS or p.endswith(("password", "passwd")) for p in parts):
        return "password"
    if any(p in _SECRET_WORDS for p in parts):
        return "secret"
    if parts[-1] == "key" and len(parts) >= 2:  # api_key, SECRET_KEY, maps_key; a lone `key` is a dict key
        return "secret"
    return None


def _is_value_like(value: str) -> bool:
    """False for empty, placeholder, templated, dummy, path/URL and one- or two-letter-repeat values."""
    if not value or len(set(value)) <= 2 or value.lower() in _DUMMY_VALUES:
        return False
    return not (_TEMPLATED.search(value) or _PATH_VALUE.search(value))


def _is_generic_secret(value: str, config: Redaction) -> bool:
    """A token-shaped value: no spaces, long, with letters and digits, and enough entropy."""
    return (
        len(value) >= config.min_secret_length
        and not any(c.isspace() for c in value)
        and any(c.isdigit() for c in value)
        and any(c.isalpha() for c in value)
        and shannon_entropy(value) >= config.min_secret_entropy
    )


def _is_password(value: str, config: Redaction) -> bool:
    """Long enough, and not a prompt or message (`"Enter your password:"`): a passphrase has a few words."""
    if len(value) < config.min_password_length:
        return False
    words = value.split()
    if len(words) > 1 and (
        len(words) > 4 or value[-1] in ":?.!" or any(name_kind(w) for w in words) or value.strip() != value
    ):
        return False
    return True


def value_kind(kind: str, value: str, config: Redaction) -> str | None:
    """The detector a literal `value` assigned to a `kind` name triggers, or None."""
    if not _is_value_like(value):
        return None
    if kind == "password":
        return "password" if _is_password(value, config) else None
    return "secret" if _is_generic_secret(value, config) else None


def _unquoted_is_literal(value: str, sep: str, text: str, end: int) -> bool:
    """An unquoted value (ending at `end` of `text`) is a literal only where config files put one: alone to
    the end of its line (`KEY=value`, `key: value`, `password = s3cr3t!`) or as a `--flag=value`. An
    identifier after a spaced `=` is code (`password = passwd`), a CamelCase word after `:` a type
    annotation (`token: Token`)."""
    bare_equals = sep == "="  # KEY=value, --flag=value, `password=x'` inside a quoted connection string
    if not (_LINE_REST_IS_EMPTY.match(text, end) or (bare_equals and text[end : end + 1] in (" ", "\t", "'", '"', ";", "&"))):
        return False
    if _IDENTIFIER.fullmatch(value) and not bare_equals and "=" in sep:
        return False
    return not (_TYPE_NAME.fullmatch(value) and ":" in sep and "=" not in sep)


class RedactionTimeout(Exception):
    """A document whose redaction ran past `redaction.time_limit_s`: the corpus build rejects it."""


class Deadline:
    """One document's CPU-time budget, shared by its text and metadata: checked before each detector's
    pass (see the module docstring for why there, and what it bounds). CPU time of the calling thread,
    not wall time, so a loaded machine or other threads holding the GIL do not push a document over."""

    def __init__(self, limit_s: float | None):
        self.limit_s = limit_s
        self._end = math.inf if limit_s is None else time.thread_time() + limit_s

    def check(self, detector: str, size: int) -> None:
        if self.limit_s is not None and time.thread_time() > self._end:
            raise RedactionTimeout(
                f"redaction ran past redaction.time_limit_s ({self.limit_s:g} s of CPU) before the {detector} "
                f"detector of a {size:,}-character text"
            )


class _Redactor:
    """One text's pass: each detector substitutes its placeholder and counts the hit."""

    def __init__(self, config: Redaction, text: str, deadline: Deadline):
        self.config = config
        self.deadline = deadline
        self.enabled = set(config.types)
        self.counts: Counter[str] = Counter()
        self._original, self._lower = text, text.lower()
        self._version_prefixes: set[tuple[str, str]] = set()  # first two parts of the dotted versions met so far

    def may_match(self, pattern: re.Pattern[str]) -> bool:
        """False when the input holds none of `pattern`'s trigger strings. Placeholders hold none either,
        so a miss on the original text is a miss on every later state of it."""
        if pattern in _TRIGGERS:
            return any(t in self._original for t in _TRIGGERS[pattern])
        if pattern in _LOWER_TRIGGERS:
            return any(t in self._lower for t in _LOWER_TRIGGERS[pattern])
        return True

    def _hit(self, kind: str, match: re.Match[str], group: str | int = 0) -> str:
        """`match` with `group` (the whole match by default) replaced by `kind`'s placeholder."""
        self.counts[kind] += 1
        start, end = match.span(group)
        whole = match.group(0)
        return whole[: start - match.start()] + PLACEHOLDERS[kind] + whole[end - match.start() :]

    def apply(self, detector: str, pattern: re.Pattern[str], replace: Callable[[re.Match[str]], str], text: str) -> str:
        """One detector's pass over `text`, if the document's budget is not spent yet."""
        self.deadline.check(detector, len(text))
        return pattern.sub(replace, text)

    def sub(self, kind: str, pattern: re.Pattern[str], text: str) -> str:
        if kind not in self.enabled or not self.may_match(pattern):
            return text
        return self.apply(kind, pattern, lambda m: self._hit(kind, m), text)

    def sub_checked(
        self, detector: str, pattern: re.Pattern[str], text: str, decide: Callable[[re.Match[str]], str | None]
    ) -> str:
        """Replace the `value` group where `decide` names an enabled kind for the match."""
        if not self.may_match(pattern):
            return text

        def replace(match: re.Match[str]) -> str:
            kind = decide(match)
            return self._hit(kind, match, "value") if kind in self.enabled else match.group(0)

        return self.apply(detector, pattern, replace, text)

    def bearer(self, match: re.Match[str]) -> str | None:
        value = match.group("value")
        return "bearer_token" if any(c.isdigit() for c in value) and any(c.isalpha() for c in value) else None

    def url_password(self, match: re.Match[str]) -> str | None:
        """Any literal password, short ones too (`admin:pw@`); not `user:${PASS}@` or `user:password@`."""
        value = match.group("value")
        literal = not (_TEMPLATED.search(value) or value.lower() in _DUMMY_VALUES or set(value) <= {"*", "x", "X"})
        return "url_password" if literal else None

    def password_shape(self, match: re.Match[str]) -> str:
        group = "value" if match.group("value") is not None else "tuple"
        found = value_kind("password", match.group(group), self.config)
        return self._hit(found, match, group) if found in self.enabled else match.group(0)

    def query_param(self, match: re.Match[str]) -> str | None:
        kind = name_kind(match.group("name"))
        return kind and value_kind(kind, match.group("value"), self.config)

    def assignment(self, match: re.Match[str]) -> str:
        kind = name_kind(match.group("name"))
        if kind is None:
            return match.group(0)
        for group in ("dq", "sq", "bq"):
            if match.group(group) is not None:
                found = value_kind(kind, match.group(group), self.config)
                return self._hit(found, match, group) if found in self.enabled else match.group(0)
        value, sep = match.group("value"), match.group("sep")
        if not _unquoted_is_literal(value, sep, match.string, match.end()):
            return match.group(0)
        found = value_kind(kind, value, self.config)
        return self._hit(found, match, "value") if found in self.enabled else match.group(0)

    def ip(self, match: re.Match[str]) -> str:
        candidate = match.group(0)
        if not _personal_ip(candidate) or _NETWORK_AFTER.match(match.string, match.end()):
            return candidate
        if self._numbered(match):
            if "." in candidate:
                self._version_prefixes.add(_first_two(candidate))
            return candidate
        return self._hit("ip_address", match)

    def _numbered(self, match: re.Match[str]) -> bool:
        """Whether the words around an address-shaped match make it a version or section number. Only the
        40 characters before it count, the line start included only if it is among them (so a heading's
        number sits within 40 characters of its line start): every look back is bounded, and a line of
        many addresses costs its length once, not once per address."""
        text, start, end = match.string, match.start(), match.end()
        window = max(0, start - 40)
        window = text.rfind("\n", window, start) + 1 or window
        before, after = text[window:start], text[end : end + 24]
        at_line_start = window == 0 or text[window - 1] == "\n"
        if _NUMBERED_BEFORE.search(before) or _NUMBERED_AFTER.search(after):
            return True
        if at_line_start and (
            _MARKDOWN_HEADING.fullmatch(before) or (_HEADING_BEFORE.fullmatch(before) and _HEADING_AFTER.match(after))
        ):
            return True
        name = _NAME_BEFORE.search(before)
        if name:
            parts = {p.lower() for p in _NAME_PARTS.findall(name.group(0))}
            if parts & _VERSION_WORDS and not parts & _ADDRESS_WORDS:
                return True
        return "." in match.group(0) and self._versions_share_prefix(match, window)

    def _versions_share_prefix(self, match: re.Match[str], window: int) -> bool:
        """Versions of one thing share their first two parts: a dotted number is one more version when a
        version found earlier in the text starts the same (`## 4.2.1.7` ... `was 4.2.1.5`), or when a
        version sits just before it (`2.7.4 (2.7.4.0)`, `v1.2.3.4 -> 1.2.3.5`). A plain address just
        before is no version, so an address range (`84.22.11.3 - 84.22.11.9`) stays addresses."""
        prefix = _first_two(match.group(0))
        if prefix in self._version_prefixes:
            return True
        previous = _DOTTED_BEFORE.search(match.string, window, match.start())
        if not previous or _first_two(previous.group("number")) != prefix:
            return False
        parts = previous.group("number").split(".")
        return bool(previous.group("v")) or len(parts) != 4 or any(int(p) > 255 for p in parts)

    def run(self, text: str) -> str:
        text = self.sub("private_key", _PRIVATE_KEY, text)
        text = self.sub("jwt", _JWT, text)
        for kind, pattern in _TOKENS.items():
            text = self.sub(kind, pattern, text)
        text = self.sub_checked("bearer_token", _BEARER, text, self.bearer)
        text = self.sub_checked("url_password", _URL_PASSWORD, text, self.url_password)  # before emails: `pw@host.com` is no address
        if self.enabled & {"secret", "password"}:
            if self.may_match(_PASSWORD_SHAPES):
                text = self.apply("password_shapes", _PASSWORD_SHAPES, self.password_shape, text)
            text = self.sub_checked("query_param", _QUERY_PARAM, text, self.query_param)
            text = self.apply("assignment", _ASSIGNMENT, self.assignment, text)
        text = self.sub("email", _EMAIL, text)
        if "ip_address" in self.enabled:
            text = self.apply("ipv4", _IPV4, self.ip, text)
            text = self.apply("ipv6", _IPV6, self.ip, text)
        return text


def _first_two(dotted: str) -> tuple[str, str]:
    major, minor = dotted.split(".")[:2]
    return major, minor


def _personal_ip(candidate: str) -> bool:
    """A routable unicast address (documentation ranges included: they stand in for real hosts). An IPv4
    address ending in .0 is its /24's network address, no host's; `1.0.0.0`-style versions end so too."""
    if "::" not in candidate and candidate.count(":") not in (0, 7):  # no address: cheaper than ValueError
        return False
    try:
        address = ipaddress.ip_address(candidate)
    except ValueError:
        return False
    if address.version == 4 and address.packed[-1] == 0:
        return False
    if address.version == 6 and address not in _GLOBAL_UNICAST_V6:
        return False
    number = int(address)
    return not any(first <= number <= last for first, last in _NOT_PERSONAL[address.version])


def redact(text: str, config: Redaction, deadline: Deadline | None = None) -> tuple[str, dict[str, int]]:
    """`text` with every enabled detector's hits replaced, and hits per type (types with no hit omitted).
    Raises `RedactionTimeout` past `deadline` (by default `config.time_limit_s` from now)."""
    redactor = _Redactor(config, text, deadline or Deadline(config.time_limit_s))
    return redactor.run(text), dict(redactor.counts)


def redact_fields(row: Mapping[str, Any], fields: Iterable[str], config: Redaction) -> tuple[dict[str, Any], dict[str, int]]:
    """`row` with each named string field (and each string inside a named mapping, like `metadata`)
    redacted, and the hits per type over all of them. Non-string values pass through. One
    `config.time_limit_s` covers the whole row: `RedactionTimeout` past it."""
    out, counts, deadline = dict(row), Counter[str](), Deadline(config.time_limit_s)
    for field in fields:
        value = out.get(field)
        if isinstance(value, str):
            out[field], found = redact(value, config, deadline)
            counts.update(found)
        elif isinstance(value, Mapping):
            inner = {}
            for key, item in value.items():
                if isinstance(item, str):
                    item, found = redact(item, config, deadline)
                    counts.update(found)
                inner[key] = item
            out[field] = inner
    return out, dict(counts)
