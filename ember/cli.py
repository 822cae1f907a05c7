"""The `ember` command line."""

from __future__ import annotations

import typer
from ember import terminal
from rich.table import Column, Table

from ember.dev import services
from ember.inference.cli import sample
from ember.pipelines.cli import app as corpus_app
from ember.pipelines.export_cli import app as export_app
from ember.rollouts.cli import app as rollouts_app

app = typer.Typer(help="ember: the data plane for post-training a coding model.", no_args_is_help=True)
dev_app = typer.Typer(help="Local real services for development and tests (Kafka, secured Kafka, Slurm, Flink job-server jar, GCS and S3 object stores).", no_args_is_help=True)
app.add_typer(dev_app, name="dev")
rollouts_app.command("sample")(sample)  # the worker needs midtrain's export reader, which rollouts may not import
app.add_typer(rollouts_app, name="rollouts")
app.add_typer(corpus_app, name="corpus")
app.add_typer(export_app, name="export")
console = terminal.console()


def _print_status() -> None:
    table = Table("service", "state", Column("address", overflow="fold"), Column("log / detail", overflow="fold"))
    for s in services.status():
        style = {"running": "green", "available": "green"}.get(s.state, "yellow")
        table.add_row(s.name, f"[{style}]{s.state}[/{style}]", s.address, s.log)
    console.print(table)


@dev_app.command("up")
def dev_up(
    only: list[str] = typer.Option(None, "--only", help="Start just these services (kafka, slurm, flink, objectstores, kafka-secure)."),
    secure: bool = typer.Option(
        False, "--secure", help="Also start kafka-secure, the SASL_SSL/SCRAM broker (same as EMBER_KAFKA_SECURITY=sasl_ssl)."
    ),
    regions: str = typer.Option(
        None, "--regions", help="Also start one KRaft cluster per region (e.g. us,eu) and MirrorMaker 2 mirroring them into kafka "
        "(with --secure: SASL_SSL regions mirrored into kafka-secure).",
    ),
) -> None:
    """Start every local service (idempotent): Kafka KRaft broker, single-node Slurm, Flink job-server jar, and the
    object stores (fake-gcs-server for gs://, moto's S3 server for s3://; `infra/objectstores.sh env` prints the
    client settings).

    With --secure (or EMBER_KAFKA_SECURITY=sasl_ssl) the secured broker kafka-secure starts as well. With --regions,
    regional clusters and MirrorMaker 2 (exactly-once) start after kafka, the central cluster (infra/regions.sh); with
    both, the regions are secured like kafka-secure and mirrored into it over SASL_SSL (docs/guides/regions.md).
    """
    try:
        region_list = services.parse_regions(regions) if regions is not None else []
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2)
    wanted = list(only or services.SERVICES)
    secure = secure or services.secure_requested()
    if region_list and not secure and "kafka" not in wanted:  # the central cluster the regions are mirrored into
        wanted.insert(0, "kafka")
    if secure and "kafka-secure" not in wanted:
        wanted.append("kafka-secure")
    unknown = [s for s in wanted if s not in services.ALL_SERVICES]
    if unknown:
        console.print(f"[red]unknown service(s) {', '.join(unknown)}; known: {', '.join(services.ALL_SERVICES)}[/red]")
        raise typer.Exit(2)
    for service in wanted:
        with console.status(f"starting {service}..."):
            try:
                services.start(service)
            except services.ServiceError as exc:
                if service != "flink":
                    console.print(f"[red]{exc}[/red]")
                    raise typer.Exit(1)
                console.print(f"[yellow]warning:[/yellow] {exc}")
    if region_list:
        with console.status(f"starting {'secured ' if secure else ''}regions {', '.join(region_list)} and MirrorMaker 2..."):
            try:
                services.start_regions(region_list, secure=secure)
            except services.ServiceError as exc:
                console.print(f"[red]{exc}[/red]")
                raise typer.Exit(1)
    _print_status()


@dev_app.command("down")
def dev_down() -> None:
    """Stop every local service this checkout started (the secured broker, regions and MirrorMaker 2 too)."""
    services.stop_regions()
    services.stop_regions(secure=True)
    for service in services.ALL_SERVICES:
        services.stop(service)
    _print_status()


@dev_app.command("status")
def dev_status() -> None:
    """Show each service, its address and its log file."""
    _print_status()


@app.command("demo")
def demo(
    rollouts: int = typer.Option(64, min=1, help="Rollouts to simulate."),
    group_size: int = typer.Option(8, min=1, help="Samples per prompt group."),
    tokens: int = typer.Option(8192, min=16, help="Tokens per rollout."),
    layers: int = typer.Option(61, min=0, help="MoE layers whose routed experts each rollout records (0: none)."),
) -> None:
    """The main job on embedded defaults: bring services up and run every stage on a small real input."""
    from ember.demo.run import run_demo

    raise typer.Exit(run_demo(console, rollouts=rollouts, group_size=group_size, tokens=tokens, layers=layers))


if __name__ == "__main__":
    app()
