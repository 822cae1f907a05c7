"""`ember rollouts ...`: topics, a rollout simulator and a decoding tail."""

from __future__ import annotations

import time

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

rollouts_app = typer.Typer(help="Kafka rollout stream: topics, simulation, inspection.", no_args_is_help=True)
topics_app = typer.Typer(help="Create or describe the ETL's topics.", no_args_is_help=True)
rollouts_app.add_typer(topics_app, name="topics")
app = rollouts_app
console = Console()

PrefixOption = typer.Option("ember", help="Topic name prefix.")


@topics_app.command("create")
def topics_create(
    prefix: str = PrefixOption,
    partitions: int = typer.Option(6, min=1, help="Partitions for the rollouts and rewards topics."),
) -> None:
    """Create the rollouts, rewards, policy-versions, train-batches and dead-letter topics (idempotent)."""
    from ember.rollouts.topics import default_topics, ensure_topics
    from ember.rollouts.transport import kafka_bootstrap

    outcome = ensure_topics(kafka_bootstrap(), list(default_topics(prefix, partitions).values()))
    for name, state in outcome.items():
        console.print(f"{name}: {state}")


@topics_app.command("describe")
def topics_describe(prefix: str = PrefixOption) -> None:
    """Show partitions of each ETL topic."""
    from ember.rollouts.topics import default_topics, describe_topics
    from ember.rollouts.transport import kafka_bootstrap

    table = Table("topic", "partitions", "error")
    for row in describe_topics(kafka_bootstrap(), [s.name for s in default_topics(prefix).values()]):
        table.add_row(str(row["name"]), str(row["partitions"]), str(row["error_code"]))
    console.print(table)


@rollouts_app.command("simulate")
def simulate(
    prefix: str = PrefixOption,
    groups: int = typer.Option(8, min=1, help="Prompt groups to publish."),
    group_size: int = typer.Option(8, min=1, help="Samples per group."),
    tokens: int = typer.Option(2048, min=16, help="Tokens per rollout."),
    layers: int = typer.Option(61, min=0, help="MoE layers with routed experts (0: none)."),
    seed: int = typer.Option(0, help="Random seed."),
) -> None:
    """Publish synthetic agent rollouts and their rewards, as an inference fleet and graders would."""
    from ember.rollouts.simulate import synthetic_reward, synthetic_rollout
    from ember.rollouts.topics import default_topics, ensure_topics
    from ember.rollouts.transport import RecordWriter, kafka_bootstrap

    topics = default_topics(prefix)
    ensure_topics(kafka_bootstrap(), list(topics.values()))
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    with RecordWriter(topics["rollouts"].name) as rollout_writer, RecordWriter(topics["rewards"].name) as reward_writer:
        for g in range(groups):
            for _ in range(group_size):
                rollout = synthetic_rollout(
                    rng, group_id=f"g{seed}-{g}", prompt_id=f"p{g}", num_tokens=tokens, layers=layers or None
                )
                rollout_writer.write(rollout)
                reward_writer.write(synthetic_reward(rng, rollout))
    elapsed = time.perf_counter() - started
    console.print(
        f"published {rollout_writer.records} rollouts ({rollout_writer.bytes / 1e6:.1f} MB) and "
        f"{reward_writer.records} rewards in {elapsed:.1f}s"
    )


@rollouts_app.command("tail")
def tail(
    topic: str = typer.Argument(..., help="Topic to read from the beginning."),
    limit: int = typer.Option(20, min=1, help="Messages to show."),
) -> None:
    """Decode and summarise messages; bad ones are shown with topic/partition/offset and the reason."""
    from kafka import KafkaConsumer

    from ember.rollouts.transport import BadMessage, consumer_config, read_messages

    consumer = KafkaConsumer(topic, **consumer_config(group_id=None))
    try:
        for item in read_messages(consumer, limit=limit, idle_timeout_s=3):
            if isinstance(item, BadMessage):
                console.print(f"[red]bad[/red] {item}")
            else:
                record = item.record
                console.print(
                    f"{item.topic}[{item.partition}]@{item.offset} {type(record).__name__} "
                    f"{getattr(record, 'rollout_id', getattr(record, 'batch_id', ''))}"
                )
    finally:
        consumer.close()
