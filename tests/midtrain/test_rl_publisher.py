"""Policy versions that go backwards on a topic (a run after `simulate` announced 11) are announced and said once."""

from __future__ import annotations

import uuid

from ember.midtrain.rl.run import PolicyVersionPublisher
from ember.rollouts.records import PolicyVersion
from ember.rollouts.security import KafkaSecurity


def _version(n: int) -> PolicyVersion:
    return PolicyVersion(policy_version=n, published_at_us=1_700_000_000_000_000 + n)


def test_a_version_below_the_topics_latest_is_warned_once(kafka: str, capsys) -> None:
    prefix = f"rl-pub-{uuid.uuid4().hex[:8]}"
    earlier = PolicyVersionPublisher(prefix, kafka, KafkaSecurity())
    earlier.publish(_version(11))
    earlier.close()
    assert "warning" not in capsys.readouterr().out, "an empty topic: nothing to compare with"
    run = PolicyVersionPublisher(prefix, kafka, KafkaSecurity())
    try:
        assert run.latest == 11
        for n in (0, 1, 12):
            run.publish(_version(n))
    finally:
        run.close()
    out = capsys.readouterr().out
    assert out.count("warning") == 1
    assert f"announcing policy version 0, but {prefix}.policy-versions already holds version 11" in out
    assert "set rl.initial_policy_version to 12 or more" in out
