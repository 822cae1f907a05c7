"""The anchor of bench/bench_etl.py: a plain kafka-python consumer reading topics from the beginning to their
current end, no decode, in a process of its own so that its time counts from process start as the ETL's does.

Reads one JSON object on stdin: {"config": KafkaConsumer keyword arguments, "topics": [names], "partitions": n};
prints {"bytes": value bytes read, "messages": count, "window_s": seconds from the seek to the last message}.
"""

import json
import sys
import time

from kafka import KafkaConsumer, TopicPartition


def main() -> None:
    spec = json.load(sys.stdin)
    consumer = KafkaConsumer(**spec["config"])
    partitions = [TopicPartition(topic, p) for topic in spec["topics"] for p in range(spec["partitions"])]
    consumer.assign(partitions)
    consumer.seek_to_beginning(*partitions)
    ends = consumer.end_offsets(partitions)
    started = time.perf_counter()
    got = messages = 0
    while any(consumer.position(tp) < ends[tp] for tp in partitions):
        for batch in consumer.poll(timeout_ms=500).values():
            got += sum(len(m.value) for m in batch)
            messages += len(batch)
    window_s = time.perf_counter() - started
    consumer.close()
    print(json.dumps({"bytes": got, "messages": messages, "window_s": window_s}))


if __name__ == "__main__":
    main()
