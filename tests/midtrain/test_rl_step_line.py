"""The `[rl] step` line: a metric without a value says why, and a sampler far from the model is explained once."""

from __future__ import annotations

from types import SimpleNamespace

from ember.midtrain.rl.trainer import _print_step


def _record(step: int, outside: float, routing: float | None, replayed: bool = False) -> dict:
    record = {"step": step, "batch_id": f"b{step}", "loss": 0.5, "step_seconds": 1.0, "replayed": replayed,
              "mismatch": {"mean_abs_delta_logp": 0.1, "kl_mu_pi": 1e-3, "frac_outside": outside}}
    if routing is not None:
        record["routing_disagreement"] = routing
    return record


def test_no_routed_experts_prints_why_not_nan_and_a_far_sampler_is_explained_once(capsys) -> None:
    rl, explained = SimpleNamespace(alpha=0.5, beta=2.0, replay="off"), set()
    for step in (1, 2):
        _print_step(_record(step, 1.0, None), 2, rl, explained)
    out = capsys.readouterr().out
    assert "nan" not in out
    assert out.count("routing-disagree n/a (the batch carries no routed experts)") == 2
    assert out.count("[rl] note: outside is the share of tokens whose ratio rho = pi/mu lies outside [0.5, 2.0]") == 1


def test_a_close_sampler_prints_the_numbers_and_no_note(capsys) -> None:
    _print_step(_record(1, 0.01, 0.125), 1, SimpleNamespace(alpha=0.5, beta=2.0, replay="off"), set())
    out = capsys.readouterr().out
    assert "outside 0.010 routing-disagree 0.125 1.00s" in out and "note" not in out


def test_replay_on_a_batch_without_routed_experts_says_once_that_it_ran_without_replay(capsys) -> None:
    """An HTTP engine's rollouts carry no experts: the step runs, unreplayed, and the line says why, once."""
    rl, explained = SimpleNamespace(alpha=0.5, beta=2.0, replay="replay"), set()
    _print_step(_record(1, 0.01, 0.0, replayed=True), 3, rl, explained)
    assert "note" not in capsys.readouterr().out
    for step in (2, 3):
        _print_step(_record(step, 0.01, None), 3, rl, explained)
    out = capsys.readouterr().out
    assert out.count("[rl] note: batch b2 carries no routed experts (its sampler cannot supply them, e.g. an HTTP engine): "
                     "its steps run without router replay") == 1 and "batch b3 carries" not in out
