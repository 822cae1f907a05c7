"""`ember rollouts ...`: topics, the load generator, the ETL service, stats, replay and a decoding tail."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

rollouts_app = typer.Typer(help="Kafka rollout stream: topics, simulation, ETL, stats, replay, inspection.", no_args_is_help=True)
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
    from ember.rollouts.admin import ensure_topics
    from ember.rollouts.config import kafka_bootstrap
    from ember.rollouts.topics import Topics

    outcome = ensure_topics(kafka_bootstrap(), list(Topics(prefix).specs(partitions).values()))
    for name, state in outcome.items():
        console.print(f"{name}: {state}")


@topics_app.command("describe")
def topics_describe(prefix: str = PrefixOption) -> None:
    """Show partitions of each ETL topic."""
    from ember.rollouts.admin import describe_topics
    from ember.rollouts.config import kafka_bootstrap
    from ember.rollouts.topics import Topics

    table = Table("topic", "partitions", "error")
    for row in describe_topics(kafka_bootstrap(), [s.name for s in Topics(prefix).specs().values()]):
        table.add_row(str(row["name"]), str(row["partitions"]), str(row["error_code"]))
    console.print(table)


def _regions(text: str) -> dict[str, float]:
    regions = {}
    for part in text.split(","):
        name, _, delay = part.partition("=")
        try:
            regions[name.strip()] = float(delay or 0)
        except ValueError:
            raise typer.BadParameter(f"region {part!r}: expected name=delay_seconds, e.g. us-east=0,eu-west=0.4") from None
    return regions


@rollouts_app.command("simulate")
def simulate(
    prefix: str = PrefixOption,
    groups: int = typer.Option(8, min=1, help="Prompt groups to publish."),
    group_size: int = typer.Option(8, min=1, help="Samples per group."),
    tokens: int = typer.Option(2048, min=16, help="Median tokens per rollout (lengths are long-tailed)."),
    length_sigma: float = typer.Option(0.5, min=0, help="Log-normal sigma of rollout lengths (0: all equal)."),
    layers: int = typer.Option(61, min=0, help="MoE layers with routed experts (0: none)."),
    partitions: int = typer.Option(6, min=1, help="Partitions of the rollouts/rewards topics if they are created."),
    regions: str = typer.Option("us-east=0,eu-west=0.4,ap-south=1.5", help="Regions and their publish delays in seconds."),
    group_interval: float = typer.Option(0.05, min=0, help="Seconds between group starts."),
    reward_delay: float = typer.Option(0.5, min=0, help="Mean seconds from episode end to reward."),
    p_missing_reward: float = typer.Option(0.0, min=0, max=1, help="Fraction of rollouts never rewarded."),
    p_late_reward: float = typer.Option(0.0, min=0, max=1, help="Fraction of rewards delayed by --late-delay."),
    late_delay: float = typer.Option(60.0, min=0, help="Extra seconds for late rewards."),
    p_duplicate_reward: float = typer.Option(0.0, min=0, max=1, help="Fraction of rewards sent twice."),
    p_duplicate_rollout: float = typer.Option(0.0, min=0, max=1, help="Fraction of rollouts sent twice (producer retries)."),
    p_truncated: float = typer.Option(0.0, min=0, max=1, help="Fraction of rollouts truncated at max length."),
    p_malformed: float = typer.Option(0.0, min=0, max=1, help="Malformed messages per rollout."),
    policy_versions: int = typer.Option(1, min=1, help="Policy versions announced over the run."),
    p_stale: float = typer.Option(0.0, min=0, max=1, help="Fraction of rollouts from an old policy."),
    stale_lag: int = typer.Option(10, min=1, help="How many versions behind a stale rollout is."),
    time_scale: float = typer.Option(1.0, min=0.001, help="Simulated seconds per real second (inf: no waiting)."),
    seed: int = typer.Option(0, help="Random seed."),
) -> None:
    """Publish a simulated fleet: rollouts from several regions, rewards, policy versions and faults."""
    from ember.rollouts.admin import ensure_topics
    from ember.rollouts.config import kafka_bootstrap
    from ember.rollouts.simulate import WorkloadSpec, plan_workload, publish_workload
    from ember.rollouts.topics import Topics

    topics = Topics(prefix)
    ensure_topics(kafka_bootstrap(), list(topics.specs(partitions).values()))
    spec = WorkloadSpec(
        groups=groups,
        group_size=group_size,
        tokens=tokens,
        length_sigma=length_sigma,
        layers=layers or None,
        regions=_regions(regions),
        group_interval_s=group_interval,
        reward_delay_s=reward_delay,
        p_missing_reward=p_missing_reward,
        p_late_reward=p_late_reward,
        late_delay_s=late_delay,
        p_duplicate_reward=p_duplicate_reward,
        p_duplicate_rollout=p_duplicate_rollout,
        p_truncated=p_truncated,
        p_malformed=p_malformed,
        policy_versions=policy_versions,
        p_stale=p_stale,
        stale_lag=stale_lag,
        seed=seed,
    )
    events = plan_workload(spec)
    stats = publish_workload(events, topics, time_scale=time_scale)
    rollout_bytes = stats.bytes.get("rollouts", 0)
    console.print(
        f"published {stats.counts} in {stats.seconds:.1f}s; rollouts {rollout_bytes / 1e6:.1f} MB on the wire, "
        f"{rollout_bytes / max(1, stats.tokens):.1f} B/token"
    )


def _etl_config(path: Path):
    from ember.configs import EtlConfigError
    from ember.rollouts.config import load_config

    try:
        return load_config(path)
    except EtlConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


@rollouts_app.command("etl")
def etl(
    config: Path = typer.Argument(..., help="ETL config YAML (see ember/rollouts/etl.example.yaml)."),
    instance: str = typer.Option("0", help="Distinct per process: transactional id and static group member."),
    until_idle: float = typer.Option(None, help="Exit once nothing is pending and no input came for this many seconds."),
    log_level: str = typer.Option("INFO", help="Python log level."),
) -> None:
    """Run one ETL process: validate, filter, join rewards, compute advantages, commit batches exactly once."""
    import logging
    import signal
    import threading

    from ember.rollouts.etl import EtlService, TopologyError
    from ember.rollouts.metrics import EtlMetrics

    settings = _etl_config(config)
    # force: an import may already have configured the root logger (Beam warns at import time)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("kafka").setLevel(logging.ERROR)
    metrics = EtlMetrics()
    if settings.metrics.port is not None:
        console.print(f"metrics on http://127.0.0.1:{metrics.serve(settings.metrics.port)}/metrics")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        EtlService(settings, instance, metrics).run(stop, until_idle_s=until_idle)
    except TopologyError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


@rollouts_app.command("stats")
def stats(
    config: Path = typer.Argument(..., help="The ETL config YAML (topics and consumer group)."),
    window: float = typer.Option(300.0, min=0, help="Seconds of ledger to summarise (0: everything)."),
) -> None:
    """Is data flowing and how stale is it: input lag, batches, drops by reason, dead letters."""
    from ember.rollouts.stats import collect_stats, render_stats

    render_stats(collect_stats(_etl_config(config), window_s=window), console)


@rollouts_app.command("replay")
def replay(
    config: Path = typer.Argument(..., help="The ETL config YAML to start from."),
    start: str = typer.Option("earliest", "--from", help="earliest | ISO time | unix seconds | rollouts:0=120,rewards:0=80"),
    to: str = typer.Option(..., "--to", help="topic:NAME, or a directory for batches.arrow + outcomes.jsonl"),
    advantage: str = typer.Option(None, help="Override advantages.estimator (grpo, dr_grpo, rloo)."),
    overrides: list[str] = typer.Option(None, "--set", help="Override any setting, e.g. --set filters.max_policy_lag=2"),
) -> None:
    """Rebuild batches from the retained log with different settings (ablations, debugging)."""
    import json

    import yaml

    from ember.configs import EtlConfigError
    from ember.rollouts.replay import parse_start, replay as run_replay

    settings = _etl_config(config)
    sections: dict[str, dict] = {}
    for item in overrides or []:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        if not name or not value:
            raise typer.BadParameter(f"--set {item!r}: expected section.key=value")
        sections.setdefault(section, {})[name] = yaml.safe_load(value)
    if advantage:
        sections.setdefault("advantages", {})["estimator"] = advantage
    try:
        settings = settings.with_overrides(**sections)
        begin = parse_start(start)
    except (EtlConfigError, ValueError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    if to.startswith("topic:"):
        summary = run_replay(settings, begin, to_topic=to.removeprefix("topic:"))
    else:
        summary = run_replay(settings, begin, to_dir=Path(to))
    console.print_json(json.dumps(summary.as_dict()))


@rollouts_app.command("publish-policy")
def publish_policy(
    version: int = typer.Argument(..., min=0, help="The policy version the trainer just published."),
    prefix: str = PrefixOption,
) -> None:
    """Announce a new policy version (what the trainer does after each weight sync)."""
    from kafka import KafkaProducer

    from ember.rollouts.admin import ensure_topics
    from ember.rollouts.config import kafka_bootstrap
    from ember.rollouts.records import PolicyVersion
    from ember.rollouts.topics import Topics
    from ember.rollouts.transport import producer_config

    spec = Topics(prefix).specs()["policy_versions"]
    ensure_topics(kafka_bootstrap(), [spec])
    producer = KafkaProducer(**producer_config())
    producer.send(spec.name, key=b"policy", value=PolicyVersion.now(version).encode())
    producer.close()
    console.print(f"{spec.name}: policy version {version}")


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
