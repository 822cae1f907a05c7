"""How every ember Kafka client authenticates: TLS and SASL settings under Kafka's own names.

One model, `KafkaSecurity`, read from a config section (`kafka.security` in the ETL config,
`rollouts.security` in `midtrain rl`) with every key it does not set taken from the environment:

    EMBER_KAFKA_SECURITY_PROTOCOL   PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL
    EMBER_KAFKA_SASL_MECHANISM      PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512
    EMBER_KAFKA_SASL_USERNAME       the principal's user name
    EMBER_KAFKA_SASL_PASSWORD_FILE  a file holding the password (mode 0600)
    EMBER_KAFKA_SASL_PASSWORD       the password itself
    EMBER_KAFKA_SSL_CAFILE          PEM bundle of the CA that signed the brokers' certificates
    EMBER_KAFKA_SSL_CHECK_HOSTNAME  true | false

The model never holds a password, only where to find it (a file, or the name of an environment
variable), so no repr, log line, error or metrics label can carry one; `client_kwargs()` reads it at
the moment a client is built. There is deliberately no command-line flag for it: argv is visible to
every user of the machine. No Kafka import here, so configs stay importable without kafka-python.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from ember.configs import SECRET, StrictModel
from ember.dev.services import ROLES, SecureBroker

PASSWORD_ENV = "EMBER_KAFKA_SASL_PASSWORD"
PASSWORD_FILE_ENV = "EMBER_KAFKA_SASL_PASSWORD_FILE"
ENVIRONMENT = {
    "security_protocol": "EMBER_KAFKA_SECURITY_PROTOCOL",
    "sasl_mechanism": "EMBER_KAFKA_SASL_MECHANISM",
    "sasl_plain_username": "EMBER_KAFKA_SASL_USERNAME",
    "ssl_cafile": "EMBER_KAFKA_SSL_CAFILE",
    "ssl_check_hostname": "EMBER_KAFKA_SSL_CHECK_HOSTNAME",
}


class KafkaSecurityError(ValueError):
    """A password source that cannot be read when a client is built; names the source, never its content."""


class KafkaSecurity(StrictModel):
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="how clients reach the brokers (env EMBER_KAFKA_SECURITY_PROTOCOL)"
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        None, description="SASL mechanism; required with SASL_* protocols (env EMBER_KAFKA_SASL_MECHANISM)"
    )
    sasl_plain_username: str | None = Field(None, min_length=1, description="SASL user (env EMBER_KAFKA_SASL_USERNAME)")
    sasl_plain_password_file: Path | None = Field(
        None, description="file holding the SASL password (env EMBER_KAFKA_SASL_PASSWORD_FILE)"
    )
    sasl_plain_password_env: Annotated[str | None, SECRET] = Field(  # SECRET: where a pasted password would land
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="name of an environment variable holding the SASL password (EMBER_KAFKA_SASL_PASSWORD if set)",
    )
    ssl_cafile: Path | None = Field(None, description="CA bundle (PEM) for the brokers' certificates (env EMBER_KAFKA_SSL_CAFILE)")
    ssl_check_hostname: bool = Field(True, description="verify the broker certificate's host name (env EMBER_KAFKA_SSL_CHECK_HOSTNAME)")

    @model_validator(mode="before")
    @classmethod
    def _environment(cls, data: Any) -> Any:
        """Keys the config leaves out come from EMBER_KAFKA_*; a password source in the config wins over both env ones."""
        if not isinstance(data, dict):
            return data
        if "sasl_plain_password" in data:
            raise ValueError(
                "sasl_plain_password cannot be given in a config (it would sit in a file and in errors): "
                f"use sasl_plain_password_file or sasl_plain_password_env, or set {PASSWORD_FILE_ENV} / {PASSWORD_ENV}"
            )
        filled = dict(data)
        for key, variable in ENVIRONMENT.items():
            if key not in filled and os.environ.get(variable):
                filled[key] = os.environ[variable]
        if "sasl_plain_password_file" not in filled and "sasl_plain_password_env" not in filled:
            if os.environ.get(PASSWORD_FILE_ENV):
                filled["sasl_plain_password_file"] = os.environ[PASSWORD_FILE_ENV]
            if os.environ.get(PASSWORD_ENV):
                filled["sasl_plain_password_env"] = PASSWORD_ENV
        return filled

    @model_validator(mode="after")
    def _complete(self) -> "KafkaSecurity":
        if self.sasl_plain_password_file is not None and self.sasl_plain_password_env is not None:
            raise ValueError(
                "give one password source: sasl_plain_password_file or sasl_plain_password_env "
                f"(from the environment: {PASSWORD_FILE_ENV} or {PASSWORD_ENV}), not both"
            )
        if self.sasl:
            if self.sasl_mechanism is None:
                raise ValueError(
                    f"sasl_mechanism is required with security_protocol={self.security_protocol} "
                    f"(set it or {ENVIRONMENT['sasl_mechanism']}; the ember broker uses SCRAM-SHA-512)"
                )
            if self.sasl_plain_username is None:
                raise ValueError(
                    f"sasl_plain_username is required with security_protocol={self.security_protocol} "
                    f"(set it or {ENVIRONMENT['sasl_plain_username']})"
                )
            if self.sasl_plain_password_file is None and self.sasl_plain_password_env is None:
                raise ValueError(
                    f"a password source is required with security_protocol={self.security_protocol}: set "
                    f"sasl_plain_password_file or sasl_plain_password_env (or {PASSWORD_FILE_ENV} / {PASSWORD_ENV})"
                )
        elif self.sasl_mechanism is not None:
            raise ValueError(f"sasl_mechanism is set but security_protocol={self.security_protocol} does not use SASL")
        return self

    @property
    def sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    def describe(self) -> str:
        """Who connects how, for a log line: protocol, mechanism and user, never the password."""
        if not self.sasl:
            return self.security_protocol
        return f"{self.security_protocol} {self.sasl_mechanism} as {self.sasl_plain_username}"

    def client_kwargs(self) -> dict[str, object]:
        """The kafka-python keyword arguments for these settings (producer, consumer and admin alike).

        The only place the password is read; the dict goes straight into a client and must never be logged.
        """
        kwargs: dict[str, object] = {"security_protocol": self.security_protocol}
        if self.tls:
            kwargs["ssl_check_hostname"] = self.ssl_check_hostname
            if self.ssl_cafile is not None:
                kwargs["ssl_cafile"] = str(self.ssl_cafile)
        if self.sasl:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_plain_username
            kwargs["sasl_plain_password"] = self._password()
        return kwargs

    def _password(self) -> str:
        if self.sasl_plain_password_file is not None:
            path = self.sasl_plain_password_file
            try:
                password = path.read_text().strip()
            except OSError as exc:
                raise KafkaSecurityError(f"sasl_plain_password_file {path}: cannot read it: {exc.strerror}") from None
            if not password:
                raise KafkaSecurityError(f"sasl_plain_password_file {path} is empty")
            return password
        variable = self.sasl_plain_password_env
        password = os.environ.get(variable or "", "")
        if not password:
            raise KafkaSecurityError(f"the environment variable {variable} (sasl_plain_password_env) is not set or empty")
        return password


def role_securities(broker: SecureBroker) -> dict[str, KafkaSecurity]:
    """Each role's settings on ember's local secured broker (`ember dev up --secure`), for tests and benchmarks."""
    return {
        role: KafkaSecurity(
            security_protocol=broker.security_protocol,
            sasl_mechanism=broker.sasl_mechanism,
            sasl_plain_username=broker.username(role),
            sasl_plain_password_file=broker.password_file(role),
            ssl_cafile=broker.cafile,
        )
        for role in ROLES
    }
