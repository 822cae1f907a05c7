"""Prometheus metrics of one grading process: how fast rollouts are graded, how gradings end, how far behind it is.

Counters move only after the transaction that published the rewards commits, so a crash never counts a reward
twice. Labels come from closed sets (the config's grader names, `Verdict`, `DeadReason`), never from message
content. A grader with metrics of its own (the judge's request latency and errors) defines `bind_metrics(registry)`:
the service hands it this registry once, so one endpoint shows all.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class GraderMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rollouts = Counter("ember_grader_rollouts", "Rollouts graded (rewards committed for every grader)", registry=r)
        self.verdicts = Counter("ember_grader_verdicts", "Committed rewards by grader and verdict", ["grader", "verdict"], registry=r)
        self.dead_letters = Counter("ember_grader_dead_letters", "Rollouts dead-lettered by the grader", ["reason"], registry=r)
        self.transactions = Counter("ember_grader_transactions", "Kafka transactions", ["result"], registry=r)
        self.recoveries = Counter("ember_grader_recoveries", "Times the service rebuilt its clients after a Kafka error", registry=r)
        self.grading_seconds = Histogram(
            "ember_grader_batch_seconds", "Wall time of one grader on one polled batch", ["grader"], buckets=_SECONDS, registry=r
        )
        self.lag = Gauge("ember_grader_consumer_lag", "Rollouts not yet graded: end offset minus position", ["partition"], registry=r)

    def serve(self, port: int, bind: str = "127.0.0.1") -> int:
        """Start the /metrics endpoint on `bind`; port 0 picks a free one. Returns the port."""
        server, _thread = start_http_server(port, addr=bind, registry=self.registry)
        return int(server.server_port)
