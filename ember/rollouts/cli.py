"""`ember rollouts ...`: topics, ACLs, the load generator, the grading and ETL services, stats, replay and a decoding tail.

Commands without a config take their Kafka security settings from EMBER_KAFKA_* (see
`ember.rollouts.security`); those with one from its `kafka.security` section, falling back to the same
variables. A password is never a flag.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import typer
from ember import terminal
from rich.table import Column, Table
from rich.markup import escape

rollouts_app = typer.Typer(help="Kafka rollout stream: topics, simulation, grading, ETL, stats, replay, inspection.", no_args_is_help=True)
topics_app = typer.Typer(help="Create, describe or delete the topics of a prefix.", no_args_is_help=True)
rollouts_app.add_typer(topics_app, name="topics")
app = rollouts_app
console = terminal.console()

PREFIX_HELP = "Topic name prefix: the topics are PREFIX.rollouts, PREFIX.rewards, ... (`topics create` makes them)."
PrefixOption = typer.Option(..., "--prefix", help=PREFIX_HELP + " Required: no default names another deployment's topics.")


def _env_security():
    """KafkaSecurity from EMBER_KAFKA_*, or exit 2 naming what is wrong."""
    from pydantic import ValidationError

    from ember.configs import error_lines
    from ember.rollouts.security import KafkaSecurity

    try:
        return KafkaSecurity()
    except ValidationError as exc:
        console.print("[red]Kafka security settings from EMBER_KAFKA_* are invalid:\n  " + "\n  ".join(error_lines(exc)) + "[/red]", soft_wrap=True)
        raise typer.Exit(2) from None


@contextmanager
def _refusals() -> Iterator[None]:
    """A password that cannot be read, or a broker that refuses this principal, ends the command with exit 2 and why."""
    from kafka.errors import AuthorizationError, SaslAuthenticationFailedError

    from ember.rollouts.admin import AdminRefused
    from ember.rollouts.security import KafkaSecurityError
    from ember.rollouts.transport import TopicUnavailable

    try:
        yield
    except (KafkaSecurityError, AdminRefused, TopicUnavailable) as exc:
        console.print(f"[red]{exc}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    except (AuthorizationError, SaslAuthenticationFailedError) as exc:
        console.print(f"[red]refused by the broker: {exc!r}; check the principal's ACLs (`ember rollouts acls`) and credentials[/red]", soft_wrap=True)
        raise typer.Exit(2) from None


REGION_ROLES = ("rollouts", "rewards")  # what a region produces; policy versions arrive mirrored from central


def _region_bootstrap(region: str, security) -> str:
    """A region's cluster from `ember dev up --regions`: the secured set when the client is secured (its credentials
    are good on every secured cluster), the plaintext one else; exit 2 in one line when it was never started."""
    from ember.dev import services

    try:
        return services.region_bootstrap(region, secure=security.security_protocol != "PLAINTEXT")
    except services.ServiceError as exc:
        console.print(f"[red]{exc}[/red]", soft_wrap=True)
        raise typer.Exit(2)


def _topic_list() -> str:
    from ember.rollouts.topics import Topics

    return ", ".join(s.name.removeprefix("PREFIX.") for s in Topics("PREFIX").specs().values())


@topics_app.command("create", help=f"Create every topic of a prefix ({_topic_list()}) as PREFIX.<name>; idempotent.")
def topics_create(
    prefix: str = PrefixOption,
    partitions: int = typer.Option(6, min=1, help="Partitions for the rollouts, rewards and etl-state topics."),
    region: str = typer.Option(
        None, "--region", help="Make a region's topics (rollouts, rewards) on its cluster (`ember dev up --regions`; with "
        "EMBER_KAFKA_SECURITY_PROTOCOL set, the secured regions of `--regions R --secure`); MirrorMaker 2 copies them into "
        "the central cluster as REGION.PREFIX.<name>.",
    ),
) -> None:
    from ember.rollouts.admin import ensure_topics
    from ember.rollouts.config import kafka_bootstrap
    from ember.rollouts.topics import Topics

    security = _env_security()
    specs = Topics(prefix).specs(partitions)
    bootstrap = kafka_bootstrap()
    if region is not None:
        bootstrap = _region_bootstrap(region, security)
        specs = {role: specs[role] for role in REGION_ROLES}
    with _refusals():
        outcome = ensure_topics(bootstrap, list(specs.values()), security)
    for name, state in outcome.items():
        console.print(f"{name}: {state}")


@topics_app.command("delete", help=f"Delete every topic of a prefix ({_topic_list()}), after confirmation.")
def topics_delete(
    prefix: str = PrefixOption,
    yes: bool = typer.Option(False, "--yes", "-y", help="Delete without asking."),
) -> None:
    from ember.rollouts.admin import delete_topics, list_topics
    from ember.rollouts.config import kafka_bootstrap
    from ember.rollouts.topics import Topics

    security = _env_security()
    names = [s.name for s in Topics(prefix).specs().values()]
    with _refusals():
        present = [name for name in names if name in set(list_topics(kafka_bootstrap(), security))]
        if not present:
            console.print(f"[red]no topic of prefix {prefix!r} exists (looked for {', '.join(names)})[/red]", soft_wrap=True)
            raise typer.Exit(2)
        console.print("will delete, with every record in them:\n  " + "\n  ".join(present))
        if not yes and not typer.confirm(f"delete these {len(present)} topics?", default=False):
            console.print("nothing deleted")
            raise typer.Exit(1)
        deleted = delete_topics(kafka_bootstrap(), present, security)
    for name in deleted:
        console.print(f"{name}: deleted")


@topics_app.command("describe")
def topics_describe(prefix: str = PrefixOption) -> None:
    """Show partitions of each topic of a prefix; exit 2 when the prefix has none of them."""
    from kafka.errors import for_code

    from ember.rollouts.admin import describe_topics
    from ember.rollouts.config import kafka_bootstrap
    from ember.rollouts.topics import Topics

    security = _env_security()
    names = [s.name for s in Topics(prefix).specs().values()]
    with _refusals():
        rows = describe_topics(kafka_bootstrap(), names, security)
    if all(row["error_code"] for row in rows):
        _require_topics(prefix, names, security)
    table = Table("topic", "partitions", "error")
    for row in rows:
        table.add_row(str(row["name"]), str(row["partitions"]), for_code(row["error_code"]).__name__ if row["error_code"] else "")
    console.print(table)


def _users(items: list[str]) -> dict[str, str]:
    from ember.rollouts.acls import ROLES

    users = {}
    for item in items:
        role, _, name = item.partition("=")
        if role not in ROLES or not name:
            raise typer.BadParameter(f"--user {item!r}: expected ROLE=NAME with ROLE one of {', '.join(ROLES)}")
        users[role] = name
    return users


@rollouts_app.command("acls")
def acls(
    prefix: str = PrefixOption,
    etl_group: str = typer.Option(None, help="The ETL's consumer group (kafka.group_id); default <prefix>-etl."),
    trainer_group: str = typer.Option(None, help="The trainer's consumer group (rollouts.group_id); default <prefix>-trainer."),
    grader_group: str = typer.Option(None, help="The graders' consumer group (`rollouts grade` kafka.group_id); default <prefix>-grader."),
    user: list[str] = typer.Option(None, "--user", help="ROLE=NAME for a principal other than ember-ROLE, e.g. etl=svc-etl."),
    apply: bool = typer.Option(False, "--apply", help="Create the missing bindings on the broker (as a super user, from EMBER_KAFKA_*)."),
    regions: list[str] = typer.Option(
        None, "--region", help="A secured region (`ember dev up --regions R --secure`, repeatable): central's bindings "
        "cover its mirrored copies, and the region's cluster gets its own (inference, graders, the ETL, the mirror).",
    ),
) -> None:
    """Least-privilege ACLs per role (inference, grader, etl, trainer, and the mirror with --region): print them, and
    with --apply create them (idempotent)."""
    from ember.rollouts.acls import region_bindings, role_bindings

    users = _users(user or [])
    regions = regions or []
    clusters = {"central": role_bindings(
        prefix, etl_group=etl_group, trainer_group=trainer_group, grader_group=grader_group, users=users, regions=regions
    )}
    for region in regions:
        clusters[region] = region_bindings(prefix, grader_group=grader_group, users=users)
    outcome: dict = {}
    if apply:
        from ember.rollouts.admin import apply_acls
        from ember.rollouts.config import kafka_bootstrap

        security = _env_security()
        bootstraps = {"central": kafka_bootstrap(), **{region: _region_bootstrap(region, security) for region in regions}}
        with _refusals():
            outcome = {(cluster, b): state for cluster, bindings in clusters.items()
                       for b, state in apply_acls(bootstraps[cluster], bindings, security).items()}
    where = (lambda cluster: (cluster,)) if regions else (lambda cluster: ())  # one cluster: the table as before
    rows = [(*where("cluster"), "role", "principal", "operation", "resource", "pattern", "name", *(["applied"] if apply else []))]
    rows += [
        (*where(cluster), b.role, b.principal, b.operation, b.resource, b.pattern, b.name, *([outcome[(cluster, b)]] if apply else []))
        for cluster, bindings in clusters.items() for b in bindings
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    console.print("Topics are created by the admin (a super user) only; READ/WRITE imply DESCRIBE, WRITE implies IDEMPOTENT_WRITE.")


def _regions(text: str) -> dict[str, float]:
    regions = {}
    for part in text.split(","):
        name, _, delay = part.partition("=")
        try:
            regions[name.strip()] = float(delay or 0)
        except ValueError:
            raise typer.BadParameter(f"region {part!r}: expected name=delay_seconds, e.g. us-east=0,eu-west=0.4") from None
    return regions


def _simulate_product(topics, security, *, time_scale: float, **traffic) -> None:
    from ember.rollouts.product.simulate import ProductTraffic, plan_traffic
    from ember.rollouts.product_etl import publish_traffic

    scale = 1e9 if time_scale == float("inf") else time_scale
    plan = plan_traffic(ProductTraffic(time_scale=scale, **traffic))
    sent = publish_traffic(plan, topics, security=security, paced=time_scale != float("inf"))
    served = sum(1 for p in plan if p.role == "served")
    console.print(f"published {served} served completions and {sent - served} events to {topics.rollouts} / {topics.events}")


@rollouts_app.command("simulate")
def simulate(
    prefix: str = typer.Option(None, "--prefix", help=PREFIX_HELP + " Default: --config's topic prefix; one of them is required."),
    create_topics: bool = typer.Option(False, "--create-topics", help="Create the prefix's topics if missing (else refused)."),
    groups: int = typer.Option(8, min=1, help="Prompt groups to publish."),
    group_size: int = typer.Option(8, min=1, help="Samples per group."),
    tokens: int = typer.Option(48, min=16, help="Median tokens per rollout (lengths are long-tailed, at most --max-tokens)."),
    length_sigma: float = typer.Option(0.5, min=0, help="Log-normal sigma of rollout lengths (0: all equal)."),
    config: Path = typer.Option(
        None, "--config", help="Size the rollouts for a consumer: an RL config (model.vocab_size, num_layers, seq_len; "
        "moe.num_experts, router_topk) or an ETL config (filters.vocab_size, max_tokens); a value it cannot take is refused."),
    vocab_size: int = typer.Option(None, "--vocab-size", min=1, help="Token ids lie below this (default: --config's, else 512, the tiny RL example's)."),
    layers: int = typer.Option(None, "--layers", min=0, help="MoE layers with routed experts, 0: none (default: --config's, else 2)."),
    top_k: int = typer.Option(None, "--top-k", min=1, help="Experts per token and layer (default: --config's, else 2)."),
    num_experts: int = typer.Option(None, "--num-experts", min=1, help="Experts per layer (default: --config's, else 4)."),
    max_tokens: int = typer.Option(None, "--max-tokens", min=16, help="Longest rollout (default: --config's, else 64)."),
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
    max_segments: int = typer.Option(1, min=1, max=4096, help="Long-horizon episodes of 1..N segments (contexts joined by summaries, tool turns, one reward at the end); 1: plain rollouts."),
    p_missing_segment: float = typer.Option(0.0, min=0, max=1, help="Fraction of episode segments never sent (the episode is dropped whole)."),
    p_late_segment: float = typer.Option(0.0, min=0, max=1, help="Fraction of episode segments delayed by --late-delay."),
    product: bool = typer.Option(
        False, "--product", help="Product traffic instead (source: product): GROUPS x GROUP_SIZE served completions and "
        "long-tailed user events (most never acted on, accepts in seconds, reverts in minutes, 'kept' at an hour), "
        "their delays divided by --time-scale."),
) -> None:
    """Publish a simulated fleet: rollouts from several regions, rewards, policy versions and faults."""
    from ember.rollouts.admin import ensure_topics
    from ember.rollouts.config import kafka_bootstrap
    from ember.rollouts.simulate import WorkloadSpec, fitted_shape, latest_policy_version, plan_workload, publish_workload
    from ember.rollouts.topics import Topics

    given = {"vocab_size": vocab_size, "layers": layers, "top_k": top_k, "num_experts": num_experts, "max_tokens": max_tokens}
    consumer, config_prefix = _consumer_shape(config) if config is not None else ((None,), None)
    try:
        shape = fitted_shape(given, *consumer)
    except ValueError as exc:
        console.print(f"[red]{escape(str(exc))}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    prefix = prefix or config_prefix
    if prefix is None:
        console.print("[red]name the topics: --prefix PREFIX, or --config with the consumer's topic prefix[/red]", soft_wrap=True)
        raise typer.Exit(2)
    topics = Topics(prefix)
    security = _env_security()
    spec = WorkloadSpec(
        groups=groups,
        group_size=group_size,
        tokens=tokens,
        length_sigma=length_sigma,
        shape=shape,
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
        max_segments=max_segments,
        p_missing_segment=p_missing_segment,
        p_late_segment=p_late_segment,
    )
    with _refusals():
        if create_topics:
            ensure_topics(kafka_bootstrap(), list(topics.specs(partitions).values()), security)
        else:
            _require_topics(prefix, [topics.rollouts, topics.events if product else topics.rewards, topics.policy_versions], security)
        if product:
            _simulate_product(topics, security, completions=groups * group_size, tokens=tokens, vocab_size=shape.vocab_size,
                              policy_versions=policy_versions, time_scale=time_scale, seed=seed)
            return
        latest = latest_policy_version(topics.policy_versions, security)
        if latest is not None:
            console.print(f"{topics.policy_versions} is at version {latest}: this run announces {latest + 1} onwards")
        first = 0 if latest is None else latest + 1
        # a new run's ids must not repeat an earlier run's (same seed), or the ETL drops them as duplicates
        spec = replace(spec, first_version=first, group_prefix=f"sim-v{first}")
        stats = publish_workload(plan_workload(spec), topics, time_scale=time_scale, security=security)
    rollout_bytes = stats.bytes.get("rollouts", 0)
    console.print(
        f"published {_counted(stats.counts)} in {stats.seconds:.1f}s; rollouts {rollout_bytes / 1e6:.1f} MB on the wire, "
        f"{rollout_bytes / max(1, stats.tokens):.1f} B/token"
    )


def _require_topics(prefix: str, names: list[str], security, bootstrap: str | None = None) -> None:
    """Exit 2 when none of `names` is visible, naming them and how to make them: only `topics create` makes topics
    (a typo'd prefix would otherwise fork a deployment silently). A principal sees only the topics its ACLs let it
    describe, so when some are visible the broker is left to refuse what this principal may not do."""
    from ember.rollouts.admin import list_topics
    from ember.rollouts.config import kafka_bootstrap
    from ember.rollouts.security import KafkaSecurity

    present = set(list_topics(bootstrap or kafka_bootstrap(), security))
    if not present.intersection(names):
        who = (security or KafkaSecurity()).describe()
        console.print(
            f"[red]{', '.join(names)} {'does' if len(names) == 1 else 'do'} not exist, or {who} may not see "
            f"{'it' if len(names) == 1 else 'them'} (is the prefix right?); create the prefix's topics with "
            f"`ember rollouts topics create --prefix {escape(prefix)}`[/red]", soft_wrap=True,
        )
        raise typer.Exit(2)


def _serve_metrics(metrics, settings) -> None:
    """A service's Prometheus endpoint on `settings.bind`:`settings.port` (none when the port is null), named once."""
    if settings.port is not None:
        bind = str(settings.bind)
        console.print(f"metrics on http://{bind}:{metrics.serve(settings.port, bind)}/metrics")


def _counted(counts: dict[str, int]) -> str:
    """`1 policy_versions, 32 rollouts, 32 rewards`: in one order whatever was published first."""
    order = ["policy_versions", "rollouts", "rewards"]
    return ", ".join(f"{counts[k]} {k}" for k in sorted(counts, key=lambda k: (order.index(k) if k in order else len(order), k)))


def _consumer_shape(path: Path):
    """((PolicyShape, where, keys), topic prefix) of the RL or ETL config at `path`; exit 2 naming a bad key."""
    from ember import configs
    from ember.configs import EtlConfigError
    from ember.rollouts.config import RLPolicyShape
    from ember.rollouts.simulate import PolicyShape

    try:
        data = configs.read_yaml_mapping(path, EtlConfigError)
        if "rl" in data:
            rl = configs.validate(RLPolicyShape, data, str(path), EtlConfigError)
            shape = PolicyShape(rl.model.vocab_size, rl.model.num_layers, rl.moe.router_topk, rl.moe.num_experts, rl.model.seq_len)
            keys = {"vocab_size": "model.vocab_size", "max_tokens": "model.seq_len"}
            return (shape, str(path), keys), rl.rollouts.topic_prefix
    except EtlConfigError as exc:
        console.print(f"[red]{escape(str(exc))}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    settings = _etl_config(path)
    shape = PolicyShape(settings.filters.vocab_size, None, max_tokens=settings.filters.max_tokens)
    keys = {"vocab_size": "filters.vocab_size", "max_tokens": "filters.max_tokens"}
    return (shape, str(path), keys), settings.kafka.topic_prefix


def _etl_config(path: Path):
    from ember.configs import EtlConfigError
    from ember.rollouts.config import load_config

    try:
        return load_config(path)
    except EtlConfigError as exc:
        console.print(f"[red]{exc}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None


def _overridden(settings, sections: dict[str, dict]):
    """`settings.with_overrides(**sections)`, or exit 2 naming the bad key."""
    from ember.configs import EtlConfigError

    try:
        return settings.with_overrides(**sections)
    except EtlConfigError as exc:
        console.print(f"[red]{exc}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None


@rollouts_app.command("etl")
def etl(
    config: Path = typer.Argument(..., help="ETL config YAML (see ember/rollouts/etl.example.yaml)."),
    instance: str = typer.Option("0", help="Distinct per process: transactional id and static group member."),
    until_idle: float = typer.Option(None, help="Exit once nothing is pending and no input came for this many seconds."),
    log_level: str = typer.Option("INFO", help="Python log level."),
    metrics_bind: str = typer.Option(None, help="Address the Prometheus endpoint listens on (overrides metrics.bind; default 127.0.0.1)."),
    create_topics: bool = typer.Option(
        None, "--create-topics/--no-create-topics", help="Create missing topics (overrides kafka.create_topics; default: refuse)."
    ),
    status_interval: float = typer.Option(
        None, min=0, help="Seconds between one-line status logs (overrides metrics.status_interval_s; 0: none)."
    ),
) -> None:
    """Run one ETL process: validate, filter, join rewards, compute advantages, commit batches exactly once."""
    import threading

    settings = _etl_config(config)  # before Kafka's import: a config error comes at once
    sections: dict[str, dict] = {}
    if metrics_bind is not None:
        sections.setdefault("metrics", {})["bind"] = metrics_bind
    if status_interval is not None:
        sections.setdefault("metrics", {})["status_interval_s"] = status_interval
    if create_topics is not None:
        sections["kafka"] = {"create_topics": create_topics}
    if sections:
        settings = _overridden(settings, sections)
    from ember.rollouts.etl import EtlService, TopologyError
    from ember.rollouts.metrics import EtlMetrics
    from ember.rollouts.transport import BrokerNotReady

    metrics = EtlMetrics()
    _serve_metrics(metrics, settings.metrics)
    stop = threading.Event()
    with _service_process(log_level, stop):
        try:
            with _refusals():
                service = EtlService
                if settings.source == "product":
                    from ember.rollouts.product_etl import ProductEtlService as service
                service(settings, instance, metrics).run(stop, until_idle_s=until_idle)
        except (TopologyError, BrokerNotReady) as exc:
            console.print(f"[red]{exc}[/red]", soft_wrap=True)
            raise typer.Exit(2) from None


@rollouts_app.command("grade")
def grade(
    config: Path = typer.Argument(..., help="Grader config YAML (see ember/rollouts/grade.example.yaml)."),
    instance: str = typer.Option("0", help="Distinct per process: transactional id and static group member."),
    until_idle: float = typer.Option(None, help="Exit once every owned partition is graded and no rollout came for this many seconds."),
    log_level: str = typer.Option("INFO", help="Python log level."),
    status_interval: float = typer.Option(
        None, min=0, help="Seconds between one-line status logs (overrides metrics.status_interval_s; 0: none)."
    ),
) -> None:
    """Run one grading process: read rollouts, grade each with every configured grader, publish one reward per
    grader exactly once (in the transaction that commits the rollouts' offsets); ungradable rollouts are dead-lettered."""
    import threading

    from ember.configs import GraderConfigError
    from ember.rollouts.grading.config import build_graders, load_config as load_grader_config
    from ember.rollouts.grading.sandbox import SandboxUnavailable
    from ember.rollouts.grading.tasks import TaskSetError, load_tasks
    from ember.tokenize.tokenizers import TokenizerLoadError, load_tokenizer

    try:  # before Kafka's import: a config, task set or tokenizer error comes at once
        settings = load_grader_config(config)
        if status_interval is not None:
            settings = settings.model_copy(update={"metrics": settings.metrics.model_copy(update={"status_interval_s": status_interval})})
        tasks = load_tasks(settings.tasks.path, settings.tasks.fields.model_dump(), settings.tasks.format)
        tokenizer = load_tokenizer(settings.tokenizer)
        graders = build_graders(settings, tasks)
    except (GraderConfigError, TaskSetError, TokenizerLoadError) as exc:
        console.print(f"[red]{escape(str(exc))}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    except SandboxUnavailable as exc:  # this machine cannot run the sandbox (no bwrap, no pids cgroup): not the config
        console.print(f"[red]{escape(str(exc))}[/red]", soft_wrap=True)
        raise typer.Exit(1) from None
    from ember.rollouts.grading.metrics import GraderMetrics
    from ember.rollouts.grading.service import GraderTopologyError, GradingService
    from ember.rollouts.transport import BrokerNotReady

    metrics = GraderMetrics()
    _serve_metrics(metrics, settings.metrics)
    stop = threading.Event()
    with _service_process(log_level, stop):
        try:
            with _refusals():
                GradingService(settings, tasks, tokenizer.decode, graders, instance, metrics).run(stop, until_idle_s=until_idle)
        except (GraderTopologyError, BrokerNotReady) as exc:
            console.print(f"[red]{escape(str(exc))}[/red]", soft_wrap=True)
            raise typer.Exit(2) from None
        finally:
            for built in graders:  # sandboxes' cgroups, the judge's HTTP client and cache
                built.close()


@contextmanager
def _service_process(log_level: str, stop) -> Iterator[None]:
    """The ETL's logging (a short prefix keeps status lines within 100 columns; the root logger alone, whatever an
    import configured) and SIGTERM/SIGINT setting `stop`, for the run only: a command run in-process (a test, a
    notebook) leaves no handler on a stream that is gone, and no signal handler behind."""
    import logging
    import signal
    import sys

    root, kafka_logger = logging.getLogger(), logging.getLogger("kafka")
    saved = root.handlers[:], root.level, kafka_logger.level
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))
    root.handlers = [handler]
    root.setLevel(log_level.upper())
    kafka_logger.setLevel(logging.ERROR)
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, action in previous.items():
            signal.signal(sig, action)
        handler.flush()
        root.handlers = saved[0]
        root.setLevel(saved[1])
        kafka_logger.setLevel(saved[2])


@rollouts_app.command("stats")
def stats(
    config: Path = typer.Argument(..., help="The ETL config YAML (topics and consumer group)."),
    window: float = typer.Option(300.0, min=0, help="Seconds of ledger to summarise (0: everything)."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh until Ctrl-C."),
    interval: float = typer.Option(5.0, min=0.1, help="Seconds between refreshes with --watch."),
    count: int = typer.Option(None, min=1, hidden=True, help="With --watch, stop after this many refreshes (tests)."),
    regions: list[str] = typer.Option(
        None, "--region", help="Also show, per partition, how far MirrorMaker 2 is behind this region (repeatable)."
    ),
) -> None:
    """Is data flowing and how stale is it: input lag, batches, drops by reason, dead letters; with --region, the
    region's committed rollouts and rewards not yet copied into the central cluster."""
    from ember.rollouts.stats import collect_stats, render_stats, watch_stats

    settings = _etl_config(config)
    if regions:
        _render_mirror_lag(settings, regions)
    with _refusals():
        if watch:
            try:
                watch_stats(settings, console, window_s=window, interval_s=interval, count=count)
            except KeyboardInterrupt:
                console.print("stopped watching")
        else:
            render_stats(collect_stats(settings, window_s=window), console)


def _render_mirror_lag(settings, regions: list[str]) -> None:
    from rich.table import Table

    from ember.rollouts.mirror import mirror_lag

    topics = settings.kafka.topics
    table = Table("region", "topic", "partition", "copied up to", "region end", "records not mirrored")
    for region in regions:
        bootstrap = settings.kafka.regions.get(region) or _region_bootstrap(region, settings.kafka.security)
        for row in mirror_lag(settings.kafka.bootstrap, region, bootstrap, [topics.rollouts, topics.rewards], settings.kafka.security):
            table.add_row(row.region, row.topic, str(row.partition), str(row.copied), str(row.end), str(row.behind))
    console.print(table)


@rollouts_app.command("replay")
def replay(
    config: Path = typer.Argument(..., help="The ETL config YAML to start from."),
    start: str = typer.Option("earliest", "--from", help="earliest | ISO time | unix seconds | rollouts:0=120,rewards:0=80 (a region's mirrored copy: us.rollouts:0=120)"),
    to: str = typer.Option(..., "--to", help="topic:NAME, or a directory for batches.arrow + outcomes.jsonl"),
    advantage: str = typer.Option(None, help="Override advantages.estimator (grpo, dr_grpo, rloo)."),
    overrides: list[str] = typer.Option(None, "--set", help="Override any setting, e.g. --set filters.max_policy_lag=2"),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object (for scripts), not a table."),
) -> None:
    """Rebuild batches from the retained log with different settings (ablations, debugging); prints what it made."""
    import json

    import yaml

    from ember.rollouts.engine import input_topics
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
    settings = _overridden(settings, sections)
    try:
        begin = parse_start(start)
        begin.check_sources(input_topics(settings.kafka.topics, settings.source, settings.kafka.regions))
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    with _refusals():
        if to.startswith("topic:"):
            summary = run_replay(settings, begin, to_topic=to.removeprefix("topic:"))
        else:
            summary = run_replay(settings, begin, to_dir=Path(to))
    found = summary.as_dict()
    if as_json:
        console.print_json(json.dumps(found))
        return
    table = Table("replayed", Column("", justify="right"), title=f"replay of {settings.kafka.topic_prefix} -> {to}")
    for key in ("messages", "rollouts", "batches", "tokens"):
        table.add_row(key, f"{found[key]:,}")
    for key, n in found["outcomes"].items():
        table.add_row(f"  {key}", f"{n:,}")
    table.add_row("seconds", f"{found['seconds']:.1f}")
    console.print(table)


@rollouts_app.command("publish-policy")
def publish_policy(
    version: int = typer.Argument(..., min=0, help="The policy version the trainer just published."),
    prefix: str = PrefixOption,
) -> None:
    """Announce a new policy version (what the trainer does after each weight sync)."""
    from kafka import KafkaProducer

    from ember.rollouts.records import PolicyVersion
    from ember.rollouts.topics import Topics
    from ember.rollouts.transport import producer_config

    spec = Topics(prefix).specs()["policy_versions"]
    security = _env_security()
    with _refusals():
        _require_topics(prefix, [spec.name], security)
        producer = KafkaProducer(**producer_config(security))
        try:
            producer.send(spec.name, key=b"policy", value=PolicyVersion.now(version).encode()).get(timeout=30)
        finally:
            producer.close()
    console.print(f"{spec.name}: policy version {version}")


@rollouts_app.command("tail")
def tail(
    topic: str = typer.Argument(
        ..., help="Topic to read from the beginning: with --prefix one of the names `topics create` makes (rollouts, "
        "rewards, ...), else a whole topic name (PREFIX.<name>, or any wire-format topic)."
    ),
    prefix: str = typer.Option(None, "--prefix", help=PREFIX_HELP + " With it, TOPIC is the short name."),
    limit: int = typer.Option(20, min=1, help="Messages to show."),
    idle_timeout: float = typer.Option(3.0, min=0.1, help="Stop once nothing arrived for this many seconds."),
) -> None:
    """Decode and summarise messages (tokens, reward, policy version, advantages, group; a dead letter's reason and
    source offset); bad ones are shown with topic/partition/offset and the reason. Exit 2 if the topic is missing."""
    from kafka import KafkaConsumer

    from ember.rollouts.tail import describe, read_records
    from ember.rollouts.topics import Topics
    from ember.rollouts.transport import consumer_config, topic_partitions

    if prefix is not None:
        names = {spec.name.removeprefix(f"{prefix}."): spec.name for spec in Topics(prefix).specs().values()}
        if topic not in names:
            console.print(f"[red]with --prefix, TOPIC is one of {', '.join(names)}; got {escape(topic)!r}[/red]", soft_wrap=True)
            raise typer.Exit(2)
        topic = names[topic]
    security = _env_security()
    with _refusals():
        consumer = KafkaConsumer(**consumer_config(security, group_id=None))
        try:
            partitions = topic_partitions(consumer, topic, security)
            consumer.assign(partitions)
            consumer.seek_to_beginning(*partitions)
            for message in read_records(consumer, limit=limit, idle_timeout_s=idle_timeout):
                line = describe(message)
                console.print(str(line), style="red" if line.bad else None, markup=False, highlight=False, soft_wrap=True)
        finally:
            consumer.close()
