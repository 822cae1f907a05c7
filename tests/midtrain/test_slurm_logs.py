"""What `midtrain status` and `midtrain logs --follow` print of a trainer log that is still being written."""

from __future__ import annotations

from pathlib import Path

from ember.midtrain.slurm import LogFollower, last_line_with


def test_the_last_step_is_a_finished_line_as_a_terminal_shows_it(tmp_path: Path) -> None:
    log = tmp_path / "train-7-0.log"
    log.write_text("[train] step 1/4 loss 5.1\n\x1b[32m[train] step 2/4 loss 4.9\x1b[0m\r\n[train] step 3/4 lo")
    assert last_line_with(log, "] step ") == "[train] step 2/4 loss 4.9", "an unfinished line is not a step yet"
    log.write_text("saving 10%\rsaving 100%\r\n[train] step 1/4 loss 5.1\n")
    assert last_line_with(log, "saving") == "saving 100%"
    assert last_line_with(log, "no such marker") is None


def test_following_a_log_that_ends_mid_line_ends_that_line(tmp_path: Path) -> None:
    """The job is unknown to slurmctld (or there is no Slurm here): the follower reads the logs once and stops."""
    slurm_log = tmp_path / "slurm-999999999.out"
    slurm_log.write_text("starting\n")
    (tmp_path / "train-999999999-0.log").write_text("[train] step 1/4 loss 5.1\n[train] step 2/4")
    written: list[str] = []
    LogFollower({"JobId": "999999999", "StdOut": str(slurm_log)}, written.append, poll_s=0.01).follow()
    text = "".join(written)
    assert text.endswith("[train] step 2/4\n"), text
    assert text.count("==> ") == 2 and text.startswith(f"==> {slurm_log} <==\nstarting\n"), text
