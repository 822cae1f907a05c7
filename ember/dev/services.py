"""Python face of the infra/ scripts: `ember dev up|down|status` and test fixtures call these."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
INFRA_DIR = REPO_ROOT / "infra"
# What `ember dev up` and the demo start by default.
SERVICES = ("kafka", "slurm", "flink", "objectstores")
# Opt-in services: `ember dev up --secure` / EMBER_KAFKA_SECURITY=sasl_ssl, or services.start(name).
OPTIONAL_SERVICES = ("kafka-secure",)
ALL_SERVICES = SERVICES + OPTIONAL_SERVICES
# Kafka principals of the secured broker, one per role (infra/kafka-secure.sh creates them).
ROLES = ("admin", "inference", "grader", "etl", "trainer", "mirror")  # mirror: MirrorMaker 2 (regions --secure)
SECURITY_ENV = "EMBER_KAFKA_SECURITY"
# A region names a cluster alias in MM2 and a topic prefix (`us.<prefix>.rollouts`): the rule of infra/regions.sh.
REGION_NAME = re.compile(r"[a-z][a-z0-9]{0,15}")
CENTRAL = "central"


class ServiceError(RuntimeError):
    """A service script failed; the message carries its output so the cause is visible."""


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    state: str
    address: str
    log: str


@dataclass(frozen=True)
class SecureBroker:
    """Where a client finds the secured broker (infra/kafka-secure.sh): SASL_SSL, SCRAM-SHA-512, local CA.

    Passwords stay in their mode-0600 files; read them with `password_file(role).read_text().strip()`.
    """

    bootstrap: str
    credentials: Path
    cafile: Path
    security_protocol: str = "SASL_SSL"
    sasl_mechanism: str = "SCRAM-SHA-512"

    def username(self, role: str) -> str:
        _check_role(role)
        return f"ember-{role}"

    def password_file(self, role: str) -> Path:
        _check_role(role)
        return self.credentials / f"{role}.password"

    def properties_file(self, role: str) -> Path:
        """Java client properties (mode 0600) for Kafka's own tools: `--command-config <file>`."""
        _check_role(role)
        return self.credentials / f"{role}.properties"


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown Kafka role {role!r}; roles are {', '.join(ROLES)}")


def secure_requested() -> bool:
    """True when EMBER_KAFKA_SECURITY asks for the secured broker (sasl_ssl)."""
    return os.environ.get(SECURITY_ENV, "").strip().lower() == "sasl_ssl"


def secure_broker() -> SecureBroker:
    """Address and credential paths of the secured broker (does not start it: see start("kafka-secure"))."""
    bootstrap = run_script("kafka-secure.sh", "bootstrap").stdout.strip()
    credentials = Path(run_script("kafka-secure.sh", "credentials").stdout.strip())
    return SecureBroker(bootstrap=bootstrap, credentials=credentials, cafile=credentials / "ca.pem")


def run_script(
    script: str, action: str, *args: str, check: bool = True, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    path = INFRA_DIR / script
    if not path.exists():
        raise ServiceError(f"{path} is missing: is this an ember checkout?")
    result = subprocess.run(
        ["bash", str(path), action, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT
    )
    if check and result.returncode != 0:
        command = " ".join([action, *args])
        raise ServiceError(
            f"infra/{script} {command} failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}".rstrip()
        )
    return result


def parse_regions(text: str) -> list[str]:
    """`us,eu` as a list; a ValueError names the bad region (the shell script refuses the same names)."""
    regions = [r.strip() for r in text.split(",") if r.strip()]
    if not regions:
        raise ValueError("--regions needs at least one region, e.g. us,eu")
    for region in regions:
        if not REGION_NAME.fullmatch(region) or region == CENTRAL:
            raise ValueError(f"region {region!r} must be 1-16 lowercase letters and digits, starting with a letter, and not {CENTRAL!r}")
    if len(set(regions)) != len(regions):
        raise ValueError(f"--regions names a region twice: {text}")
    return regions


def _regions_args(secure: bool) -> tuple[str, ...]:
    return ("--secure",) if secure else ()


def start_regions(regions: list[str], *, secure: bool = False) -> str:
    """One KRaft cluster per region and the MirrorMaker 2 node that mirrors them into the central broker (which must be
    up); idempotent. Regions are opt-in so that the default `dev up` and CI start nothing more. EMBER_MM2_OUT_TOPICS
    narrows what central sends out (see infra/regions.sh). `secure`: the SASL_SSL set, mirrored into kafka-secure, on
    its own ports beside a plaintext set."""
    return run_script("regions.sh", *_regions_args(secure), "start", ",".join(regions)).stdout


def stop_regions(*, secure: bool = False) -> str:
    return run_script("regions.sh", *_regions_args(secure), "stop").stdout


def region_bootstrap(region: str, *, secure: bool = False) -> str:
    """host:port of a region's cluster (started before by `ember dev up --regions`); a ServiceError of one line else."""
    result = run_script("regions.sh", *_regions_args(secure), "bootstrap", region, check=False)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or [f"infra/regions.sh bootstrap {region} failed (exit {result.returncode})"]
        raise ServiceError(lines[-1].removeprefix("[regions] ERROR: "))
    return result.stdout.strip()


def start(service: str) -> str:
    if service == "flink":  # stage the job server's jars, then the session cluster built from them
        return run_script("flink.sh", "fetch").stdout + run_script("flink-cluster.sh", "start").stdout
    return run_script(f"{service}.sh", "start").stdout


def stop(service: str) -> str:
    if service == "flink":
        return run_script("flink-cluster.sh", "stop").stdout
    return run_script(f"{service}.sh", "stop").stdout


def objectstores_env() -> dict[str, str]:
    """The standard client settings that point google-cloud-storage and boto3 (so Beam's GCS and S3 FileSystems)
    at the local stores of infra/objectstores.sh: STORAGE_EMULATOR_HOST, AWS_ENDPOINT_URL, dummy AWS keys, region."""
    lines = run_script("objectstores.sh", "env").stdout.splitlines()
    return dict(line.removeprefix("export ").split("=", 1) for line in lines if line.startswith("export "))


def status() -> list[ServiceStatus]:
    """One row per status line; a script may report several (objectstores.sh: gcs and s3)."""
    statuses = []
    for script, *args in [(f"{s}.sh",) for s in ALL_SERVICES] + [("flink-cluster.sh",), ("regions.sh",), ("regions.sh", "--secure")]:
        result = run_script(script, *args, "status", check=False)
        lines = [line for line in result.stdout.strip().splitlines() if "\t" in line]
        for line in lines or [f"{script[:-3]}\tunknown\t-\t{result.stderr.strip()}"]:
            name, state, address, log = (line.split("\t") + ["-"] * 4)[:4]
            statuses.append(ServiceStatus(name, state, address, log))
    return statuses
