"""Every served completion ends exactly once (trained or dropped with a reason) across crashes at any point
of the store/Kafka commit pair: a stand-in for Kafka's transaction (`Sink`) takes each outbox once, by txn."""

from hypothesis import HealthCheck, given, settings, strategies as st

from ember.rollouts.product.config import ProductSettings
from ember.rollouts.product.join import Message, ProductOutput
from ember.rollouts.product.reward import RewardFunction
from ember.rollouts.product.simulate import ProductTraffic, plan_traffic
from tests.rollouts.product.support import engine

SETTINGS = ProductSettings(reward=RewardFunction(horizon_s=2, unshown_horizon_s=1, kept_after_min=1 / 60))
PLAN = plan_traffic(ProductTraffic(completions=40, users=5, time_scale=3600, kept_minutes=1 / 60, acted=0.6, vocab_size=1000, seed=3))
SERVED_IDS = {p.key.decode() for p in PLAN if p.role == "served"}


class Sink:
    """What Kafka would hold: outputs of committed transactions, and the txn its offsets' metadata carries."""

    def __init__(self):
        self.txn = 0
        self.outputs: list[ProductOutput] = []

    def commit(self, out: ProductOutput) -> None:
        """What the service does after each checkpoint: a Kafka transaction with the outputs and the txn."""
        assert out.txn in (self.txn, self.txn + 1), f"Kafka at txn {self.txn}, the store at {out.txn}"
        if out.txn == self.txn:
            assert not (out.batches or out.outcomes), "outputs always come with a new txn"
        self.outputs.append(out)
        self.txn = out.txn


def numbered():
    seen = {"served": 0, "events": 0}
    for p in PLAN:
        yield p.role, Message(seen[p.role], p.timestamp_ms, p.key, p.value)
        seen[p.role] += 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    checkpoint_every=st.integers(1, 25),
    crashes=st.lists(st.tuples(st.integers(0, 200), st.sampled_from(["before_store", "between"])), max_size=4),
)
def test_each_completion_ends_once_across_crashes(tmp_path_factory, checkpoint_every, crashes):
    path = tmp_path_factory.mktemp("store") / "shard0.db"
    sink, crash_at = Sink(), dict(crashes)
    join = engine(path, SETTINGS)
    step = 0
    messages = list(numbered())
    i = 0
    while i < len(messages):
        role, message = messages[i]
        join.ingest(role, message)
        i += 1
        step += 1
        if step % checkpoint_every and i < len(messages):
            continue
        mode = crash_at.pop(step, None)
        if mode == "before_store":  # died mid-transaction: the store rolls back
            join.store.close()
        else:
            out = join.checkpoint()
            if mode is None:
                sink.commit(out)
                continue
            join.store.db.close()  # died after the store's commit, before Kafka's
        join = engine(path, SETTINGS)
        join.recover(sink.txn)  # what Kafka lacks is queued for the next checkpoint
        i = 0  # the consumer re-reads; the engine skips what its store already holds
    join.advance(PLAN[-1].timestamp_ms + 10**7)
    sink.commit(join.checkpoint())

    ends: dict[str, list[str]] = {}
    for out in sink.outputs:
        for batch in out.batches:
            for cid in batch.rollout_ids:
                ends.setdefault(cid, []).append("trained")
        for o in out.outcomes:
            if o.kind == "rollout_dropped":
                ends.setdefault(o.rollout_id, []).append(o.reason)
    assert set(ends) == SERVED_IDS
    assert {cid: e for cid, e in ends.items() if len(e) != 1} == {}
    assert join.pending_count() == 0
    counts = join.store.counts()
    assert sum(c.get("served", 0) for c in counts.values()) == len(SERVED_IDS)
    assert sum(c.get("trained", 0) + c.get("dropped", 0) for c in counts.values()) == len(SERVED_IDS)
    join.store.close()
