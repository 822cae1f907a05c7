"""A domain block-list for web documents: a listed domain blocks itself and every subdomain.

The list is domains, one per line in a file (blank lines and `#` comments ignored; a leading `*.` or
`.` is the same domain), or given inline in the config; the lookup walks the URL host's suffixes,
so each document costs one set lookup per label of its host whatever the list's size.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import urlsplit

_DOMAIN = re.compile(r"^(?=.{1,253}$)(?!-)[a-z0-9_-]{1,63}(?<!-)(?:\.(?!-)[a-z0-9_-]{1,63}(?<!-))*$")


def normalize_domain(entry: str) -> str:
    """'*.Example.COM.' -> 'example.com'; raises ValueError naming the entry when it is no domain name."""
    domain = entry.strip().lower().removeprefix("*.").lstrip(".").rstrip(".")
    try:
        domain = domain.encode("idna").decode("ascii") if not domain.isascii() else domain
    except UnicodeError:
        raise ValueError(f"{entry!r} is not a domain name") from None
    if not _DOMAIN.match(domain):
        raise ValueError(f"{entry!r} is not a domain name (expected e.g. example.com)")
    return domain


def parse_domain_lines(lines: Iterable[str], where: str) -> list[str]:
    """The domains of a block-list file; a line that is no domain is an error naming `where` and its line."""
    domains = []
    for number, line in enumerate(lines, 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            domains.append(normalize_domain(entry))
        except ValueError as exc:
            raise ValueError(f"{where}:{number}: {exc}") from None
    return domains


def url_host(url: str) -> str:
    """The lower-case host of a URL without port or credentials ('' when it has none)."""
    try:
        host = urlsplit(url.strip()).hostname or ""
    except ValueError:  # an unparseable netloc (a bad IPv6 literal)
        return ""
    return host.rstrip(".")


class UrlBlocklist:
    def __init__(self, domains: Iterable[str]):
        self._domains = frozenset(domains)

    def __len__(self) -> int:
        return len(self._domains)

    def blocked_by(self, url: str | None) -> str | None:
        """The listed domain that `url`'s host is or is under, else None (also for a document without URL)."""
        if not url or not self._domains:
            return None
        labels = url_host(url).split(".")
        for i in range(len(labels)):
            suffix = ".".join(labels[i:])
            if suffix in self._domains:
                return suffix
        return None
