"""When `--until-idle` may stop a grader. Regression: in CI a grader measured its lag before the group had
assigned it anything (lag 0 over no partitions), then counted that as idle once the partitions came and exited
after 3 s having graded none of a full topic."""

from __future__ import annotations

from kafka import TopicPartition

from ember.rollouts.grading.config import parse_config
from ember.rollouts.grading.service import GradingService
from tests.rollouts.etl_support import Deployment
from tests.rollouts.grading.support import grader_settings

TP = TopicPartition("t.rollouts", 0)


class Consumer:
    """The three calls the idle rule makes, with an assignment the group hands over late."""

    def __init__(self, end: int):
        self.assigned: set[TopicPartition] = set()
        self.end = end
        self.at = 0

    def assignment(self):
        return set(self.assigned)

    def end_offsets(self, partitions):
        return {tp: self.end for tp in partitions}

    def position(self, _tp):
        return self.at


def service(tmp_path) -> GradingService:
    config = parse_config(grader_settings("t", tmp_path / "tasks.jsonl", Deployment.plaintext()), base=tmp_path)
    return GradingService(config, {}, lambda ids: "", [], "0")


def test_a_lag_measured_before_the_assignment_is_not_idleness(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("ember.rollouts.grading.service.time.monotonic", lambda: clock[0])
    grading = service(tmp_path)
    consumer = grading._consumer = Consumer(end=24)
    clock[0] += 5
    grading._refresh_lag()  # nothing assigned yet: lag 0 over no partitions
    consumer.assigned = {TP}
    clock[0] += 5
    assert not grading._idle_for(3)
    grading._refresh_lag()  # measured over the partition now owned: 24 behind
    assert grading.lag == 24 and not grading._idle_for(3)


def test_idle_after_the_owned_partitions_are_read_to_the_end_for_the_whole_quiet_time(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("ember.rollouts.grading.service.time.monotonic", lambda: clock[0])
    grading = service(tmp_path)
    consumer = grading._consumer = Consumer(end=24)
    consumer.assigned, consumer.at = {TP}, 24
    clock[0] += 2
    grading._refresh_lag()
    clock[0] += 0.1
    assert grading.lag == 0 and not grading._idle_for(3)  # settled just now: the quiet time starts
    clock[0] += 2
    assert not grading._idle_for(3)
    grading._last_input = clock[0]  # a batch came: the lag must be asked again after it
    clock[0] += 2
    assert not grading._idle_for(3)
    grading._refresh_lag()
    clock[0] += 0.1
    assert not grading._idle_for(3)
    clock[0] += 3
    assert grading._idle_for(3)
