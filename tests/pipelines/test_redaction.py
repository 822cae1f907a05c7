"""Redaction: typed placeholders and per-type counts; ordinary code and prose survive untouched."""

from __future__ import annotations

from ember.pipelines.corpus_config import Redaction
from ember.pipelines.redaction import redact, shannon_entropy

ALL = Redaction()


def test_each_detector_replaces_with_its_placeholder() -> None:
    cases = {
        "mail me at jane.doe+x@mail.example.co.uk today": ("mail me at <EMAIL> today", "email"),
        "server 93.184.216.34 is up": ("server <IP_ADDRESS> is up", "ip_address"),
        "v6 2606:4700:4700::1111 here": ("v6 <IP_ADDRESS> here", "ip_address"),
        "key AKIAIOSFODNN7EXAMPLE end": ("key <KEY> end", "aws_access_key"),
        "tok ghp_abcdefghijklmnopqrstuvwxyz0123456789AB ok": ("tok <KEY> ok", "github_token"),
        "slack xoxb-123456789012-abcdefghij ok": ("slack <KEY> ok", "slack_token"),
        "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaA==\n-----END OPENSSH PRIVATE KEY-----": ("<PRIVATE_KEY>", "private_key"),
        'API_KEY = "Zq8x3Kf9LmP2vR7tW1yB"': ('API_KEY = "<KEY>"', "secret"),
        "db_password: s3cr3tPass": ("db_password: <PASSWORD>", "password"),
        '{"password": "correct horse battery"}': ('{"password": "<PASSWORD>"}', "password"),
    }
    for text, (expected, kind) in cases.items():
        assert redact(text, ALL) == (expected, {kind: 1}), text


def test_ordinary_code_and_private_addresses_are_left_alone() -> None:
    text = (
        "password = get_password()\ntoken = self.token\nkey = 'a'\nmonkey = \"banana\"\n"
        "host = '127.0.0.1' or '10.0.0.7' or '192.168.1.1'\nversion 1.2.3.4\nstd::vector<int> v; a::b\n"
        'SECRET_KEY = "<KEY>"\npassword = "********"\n@property\ndef name(self): return self._name\n'
        'API_TOKEN = "aaaaaaaaaaaaaaaaaaaaaaaa"\n'
    )
    assert redact(text, ALL) == (text, {})


def test_counts_add_up_per_type_and_types_can_be_switched_off() -> None:
    text = "a@example.org b@example.org 8.8.8.8\npassword = 'hunter2hunter2'"
    assert redact(text, ALL) == ("<EMAIL> <EMAIL> <IP_ADDRESS>\npassword = '<PASSWORD>'", {"email": 2, "ip_address": 1, "password": 1})
    only_email = Redaction(types=["email"])
    assert redact(text, only_email) == ("<EMAIL> <EMAIL> 8.8.8.8\npassword = 'hunter2hunter2'", {"email": 2})


def test_entropy_threshold_is_configurable() -> None:
    text = 'AUTH_TOKEN = "abcdabcdabcdabcd"'
    assert shannon_entropy("abcdabcdabcdabcd") == 2.0
    assert redact(text, ALL)[1] == {}
    assert redact(text, Redaction(min_secret_entropy=2.0)) == ('AUTH_TOKEN = "<KEY>"', {"secret": 1})
