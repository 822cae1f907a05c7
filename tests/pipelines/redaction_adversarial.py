"""Adversarial inputs for every regex of ember/pipelines/quality/redaction.py, shared by test_redaction.py's
linear-time test and bench/bench_redaction.py --adversarial.

`TARGETS` names, for each regex of the module, the inputs aimed at it, so a new pattern without any
fails test_every_pattern_has_adversarial_inputs.

A backtracking engine is super-linear where one failed attempt scans far and the next start position
scans the same text again, so each input repeats a detector's literal start (or the separators its
character classes share) with no end that completes a match: `sk-` x n, `%` x n then `@`, `a.a.a.`...
Some target the per-match decisions instead (the rest of the line an assignment looks at, the line
start an address looks back to). Keys are `detector: shape`; the values build a text of about `size`
characters.
"""

from __future__ import annotations

from collections.abc import Callable


def repeat(unit: str, prefix: str = "", suffix: str = "") -> Callable[[int], str]:
    """`prefix` + `unit` repeated to about `size` characters + `suffix`."""
    return lambda size: prefix + unit * max(1, (size - len(prefix) - len(suffix)) // len(unit)) + suffix


def halves(first: str, second: str) -> Callable[[int], str]:
    """`first` repeated over half of the text, then `second` over the other half, on one line."""
    return lambda size: first * (size // 2 // len(first)) + second * (size // 2 // len(second))


INPUTS: dict[str, Callable[[int], str]] = {
    "private_key: headers with no END": repeat("-----BEGIN RSA PRIVATE KEY-----\n"),
    "private_key: escaped headers with no END": repeat("-----BEGIN PRIVATE KEY-----\\n"),
    "private_key: headers, each with a base64 line": repeat("-----BEGIN EC PRIVATE KEY-----\nMIIEowIBAAKCAQEAu1SU1LfVLPHC\n"),
    "private_key: header, then a mismatched END": repeat("-----BEGIN RSA PRIVATE KEY-----\nQUJD\n-----END EC PRIVATE KEY-----\n"),
    "private_key: one BEGIN, kind words forever": repeat("PRIVATE KEY ", prefix="-----BEGIN "),
    "private_key: BEGIN without its dashes": repeat("-----BEGIN PRIVATE KEY "),
    "jwt: eyJ x n": repeat("eyJ"),
    "jwt: eyJ. x n": repeat("eyJ."),
    "jwt: two segments and a bad end": repeat("eyJhbGciOiJIUzI1.eyJzdWIiOiIxMjM0 "),
    "jwt: segments joined by dots, one long token": repeat("eyJhbGciOiJIUzI1.", prefix="x "),
    "aws_access_key: AKIA x n": repeat("AKIA"),
    "aws_access_key: AKIA and 15 characters": repeat("AKIAIOSFODNN7EXAMPL "),
    "github_token: ghp_ x n": repeat("ghp_"),
    "github_token: -ghp_ x n": repeat("-ghp_"),
    "github_token: github_pat_ x n": repeat("github_pat_"),
    "github_token: short tokens": repeat(" ghp_abcdefghijklmnopqrstuvwxyz012345678-"),
    "slack_token: xoxb- x n": repeat("xoxb-"),
    "slack_token: webhook prefixes": repeat("https://hooks.slack.com/services/TA/B"),
    "slack_token: one webhook, a long team": repeat("A", prefix="https://hooks.slack.com/services/T"),
    "api_token: sk- x n": repeat("sk-"),
    "api_token: sk-proj- x n": repeat("sk-proj-"),
    "api_token: -sk- x n": repeat("-sk-"),
    "api_token: sk-T3BlbkFJ x n": repeat("sk-T3BlbkFJ"),
    "api_token: glpat- x n": repeat("glpat-"),
    "api_token: sk_live_ x n": repeat("-sk_live_"),
    "api_token: pypi- prefix x n": repeat("-pypi-AgEIcHlwaS5vcmc"),
    "api_token: SG. x n": repeat("SG."),
    "api_token: hf_ / npm_ / AIza / SK x n": repeat("-hf_-npm_-AIza-SK"),
    "bearer_token: bearer x n": repeat("bearer "),
    "bearer_token: authorization: x n": repeat("authorization: "),
    "bearer_token: bearer and spaces": repeat(" ", prefix="bearer", suffix="!"),
    "url_password: a:// x n": repeat("a://"),
    "url_password: a://b: x n": repeat("a://b:"),
    "url_password: one URL, user:pass:pass...": repeat("b:", prefix="a://"),
    "url_password: scheme characters": repeat("a.b+c-", suffix="://"),
    "query_param: ?a x n": repeat("?a"),
    "query_param: &a.b-c x n": repeat("&a.b-c"),
    "assignment: a. x n": repeat("a."),
    "assignment: a- x n": repeat("a-"),
    "assignment: a.-_ x n, then =": repeat("a.-_", suffix="="),
    "assignment: names and spaces": repeat("a     "),
    "assignment: $a. x n": repeat("$a."),
    "assignment: 1a. x n": repeat("1a."),
    "assignment: unclosed quotes": repeat("a=\"a='a=`"),
    "assignment: password=value x n on one line": repeat("pwd=s3cr3tPa55 "),
    "assignment: password=value #comment x n": repeat("pwd=s3cr3tPa55 #"),
    "assignment: token: a.a.a... value": repeat("a.", prefix="token: "),
    "assignment: token: CamelCase... value": repeat("Ab", prefix="token: ", suffix="1"),
    "assignment: templated-looking value": repeat("<{a", prefix="password = \"", suffix="\""),
    "password_shapes: password x n": repeat("password "),
    "password_shapes: identified by x n": repeat("identified by "),
    "password_shapes: auth=( x n": repeat("auth=('"),
    "password_shapes: password 'unclosed": repeat("x", prefix="password '"),
    "email: % x n then @": repeat("%", suffix="@"),
    "email: + x n then @": repeat("+", suffix="@"),
    "email: a@ x n": repeat("a@"),
    "email: a@a. x n": repeat("a@a."),
    "email: one domain of many labels": repeat("a1.", prefix="x@"),
    "email: a.% x n then @": repeat("a.%", suffix="@"),
    "ip_address: 1. x n": repeat("1."),
    "ip_address: dotted runs": repeat("1.1.1.1.1 "),
    "ip_address: public addresses on one line": repeat("84.22.11.3 "),
    "ip_address: spaces, then addresses on one line": halves(" ", "84.22.11.3 "),
    "ip_address: versions and addresses": repeat("v1.2.3.4 84.22.11.3, "),
    "ip_address: : x n": repeat(":"),
    "ip_address: a: x n": repeat("a:"),
    "ip_address: 1:2:3:4:5:6:7:8: x n": repeat("1:2:3:4:5:6:7:8:"),
    "ip_address: public IPv6 on one line": repeat("2606:4700::1111 "),
}

TARGETS: dict[str, tuple[str, ...]] = {
    "_PRIVATE_KEY": tuple(k for k in INPUTS if k.startswith("private_key:")),
    "_JWT": tuple(k for k in INPUTS if k.startswith("jwt:")),
    **{f"_TOKENS[{kind}]": tuple(k for k in INPUTS if k.startswith(f"{kind}:"))
       for kind in ("aws_access_key", "github_token", "slack_token", "api_token")},
    "_BEARER": tuple(k for k in INPUTS if k.startswith("bearer_token:")),
    "_URL_PASSWORD": tuple(k for k in INPUTS if k.startswith("url_password:")),
    "_QUERY_PARAM": tuple(k for k in INPUTS if k.startswith("query_param:")),
    "_ASSIGNMENT": tuple(k for k in INPUTS if k.startswith("assignment:")),
    "_PASSWORD_SHAPES": tuple(k for k in INPUTS if k.startswith("password_shapes:")),
    "_EMAIL": tuple(k for k in INPUTS if k.startswith("email:")),
    "_IPV4": ("ip_address: 1. x n", "ip_address: dotted runs", "ip_address: public addresses on one line"),
    "_IPV6": ("ip_address: : x n", "ip_address: a: x n", "ip_address: 1:2:3:4:5:6:7:8: x n", "ip_address: public IPv6 on one line"),
    # the per-match decisions: names, values and the words around an address
    "_NAME_PARTS": ("assignment: a.-_ x n, then =",),
    "_LINE_REST_IS_EMPTY": ("assignment: password=value x n on one line", "assignment: password=value #comment x n"),
    "_IDENTIFIER": ("assignment: token: a.a.a... value",),
    "_TYPE_NAME": ("assignment: token: CamelCase... value",),
    "_TEMPLATED": ("assignment: templated-looking value",),
    "_PATH_VALUE": ("assignment: templated-looking value",),
    **{name: ("ip_address: public addresses on one line", "ip_address: versions and addresses")
       for name in ("_NUMBERED_BEFORE", "_NAME_BEFORE", "_DOTTED_BEFORE", "_NUMBERED_AFTER", "_NETWORK_AFTER")},
    **{name: ("ip_address: spaces, then addresses on one line",)
       for name in ("_HEADING_BEFORE", "_HEADING_AFTER", "_MARKDOWN_HEADING")},
}
