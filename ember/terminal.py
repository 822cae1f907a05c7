"""One way every command makes its rich consoles.

Piped (a CI log, `| tee`, a test's capture) rich assumes 80 columns and cuts table cells with "…"; the
consoles here are 100 columns wide then, and at most 100 on a terminal where `narrow` asks for it.
"""

from __future__ import annotations

from rich.console import Console

PIPE_WIDTH = 100


def console(*, stderr: bool = False, soft_wrap: bool = False, narrow: bool = False) -> Console:
    """A console for a command's output: the terminal's width (at most PIPE_WIDTH when `narrow`), PIPE_WIDTH piped."""
    probe = Console(stderr=stderr)
    width = (min(PIPE_WIDTH, probe.width) if narrow else probe.width) if probe.is_terminal else PIPE_WIDTH
    return Console(stderr=stderr, soft_wrap=soft_wrap, width=width)
