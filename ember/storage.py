"""One URL layer: local paths, gs:// and s3:// through Beam's FileSystems, the layer the pipelines' workers use.

Clients find their stores through the standard settings only (STORAGE_EMULATOR_HOST or Google credentials for
gs://; AWS_ENDPOINT_URL, AWS credentials and region for s3://), so the same code runs against the local stores of
infra/objectstores.sh and the real services.

A set of files (a shard set) is committed on an object store as on disk: its files first, `manifest.json` last.
Each object appears whole when its upload completes, so a reader that starts from the manifest never sees half a set;
`output_state` tells a rerun what an earlier, interrupted run left behind.

`preflight` checks a location before any work: a typo in the URL (unknown scheme, no bucket, invalid bucket name),
missing credentials, an unreachable endpoint, a missing bucket, a permission error - each named with the URL.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ember.files import is_url, write_atomically

SCHEMES = ("gs", "s3")
MANIFEST_NAME = "manifest.json"
PROBE_PREFIX = ".ember-preflight-"
_BUCKET = {
    "gs": re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$"),
    "s3": re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"),
}
_TIMEOUT_S = 10


class StorageError(RuntimeError):
    """A location cannot be used; the message names the location and what to fix."""



@dataclass(frozen=True)
class Url:
    scheme: str
    bucket: str
    key: str  # without a leading slash; "" for the bucket itself


def parse(location: str) -> Url:
    """The URL's parts; a typo (unknown scheme, no bucket, an invalid bucket name) is a StorageError naming it."""
    scheme, sep, rest = str(location).partition("://")
    if not sep:
        raise StorageError(f"{location}: not a URL (expected gs://BUCKET/... or s3://BUCKET/...)")
    if scheme not in SCHEMES:
        raise StorageError(f"{location}: unknown scheme {scheme!r}; use a local path, gs://BUCKET/... or s3://BUCKET/...")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"{location}: no bucket name after {scheme}://")
    if not _BUCKET[scheme].match(bucket):
        raise StorageError(
            f"{location}: {bucket!r} is not a valid {scheme}:// bucket name "
            "(3-63 lowercase letters, digits, dots or hyphens, starting and ending with a letter or digit)"
        )
    return Url(scheme, bucket, key.lstrip("/"))


def join(base: str | Path, *parts: str) -> str:
    if not is_url(base):
        return str(Path(base).joinpath(*parts))
    return "/".join([str(base).rstrip("/"), *(p.strip("/") for p in parts)])


def _filesystems():
    """Beam's FileSystems with pipeline options set: its S3 filesystem needs options even when none are given
    (an unset `s3_endpoint_url` leaves boto3 to read AWS_ENDPOINT_URL)."""
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.options.value_provider import RuntimeValueProvider

    if FileSystems._pipeline_options is None and RuntimeValueProvider.runtime_options is None:
        FileSystems.set_options(PipelineOptions([]))
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        _anonymous_for_the_emulator()
    return FileSystems


@functools.lru_cache(maxsize=4)
def _s3io_for(settings: tuple[str | None, ...]):
    from apache_beam.io.aws import s3io
    from apache_beam.io.aws.clients.s3 import boto3_client
    from apache_beam.options.pipeline_options import PipelineOptions

    return s3io.S3IO(client=boto3_client.Client(options=PipelineOptions([])))


def _s3():
    """Beam's S3IO (what its S3 filesystem wraps) with one boto3 client per process and settings: the filesystem
    makes a new client for every call, about a second each on a busy machine, which a set of many shards multiplies."""
    _filesystems()
    names = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE")
    return _s3io_for(tuple(os.environ.get(name) for name in names))


def _anonymous_for_the_emulator() -> None:
    """Beam looks up Google default credentials once per process and, when there are none, retries with backoff for
    about 45 s before it connects anonymously. A GCS emulator takes no credentials (google-cloud-storage itself goes
    anonymous when STORAGE_EMULATOR_HOST is set), so settle Beam's lookup as anonymous at once."""
    from apache_beam.internal.gcp.auth import _Credentials

    with _Credentials._credentials_lock:
        if not _Credentials._credentials_init:
            _Credentials._credentials, _Credentials._credentials_init = None, True


def _check(location: str | Path) -> str:
    location = str(location)
    if is_url(location):
        parse(location)
    return location


def read_bytes(location: str | Path, limit: int | None = None) -> bytes:
    """The stored bytes; with `limit`, at most `limit` + 1 of them, so that an object over the limit shows as
    longer without being fetched whole (a manifest is small; a hostile or wrong object need not be)."""
    location = _check(location)
    size = -1 if limit is None else limit + 1
    if not is_url(location):
        with Path(location).open("rb") as handle:
            return handle.read(size)
    if location.startswith("s3://"):
        io = _s3()
        if not io.exists(location):
            raise FileNotFoundError(f"{location} does not exist")
        with io.open(location, "rb") as handle:
            return handle.read(size)
    from apache_beam.io.filesystem import CompressionTypes

    fs = _filesystems()
    if not fs.exists(location):
        raise FileNotFoundError(f"{location} does not exist")
    # the stored bytes, as written: Beam would otherwise decompress by the name's extension (.gz, .zst, ...)
    with fs.open(location, compression_type=CompressionTypes.UNCOMPRESSED) as handle:
        return handle.read(size)


def write_bytes(location: str | Path, data: bytes) -> str:
    """Whole or nothing under the name: a local file is renamed into place, an object appears when its upload
    completes."""
    location = _check(location)
    if not is_url(location):
        Path(location).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(location, data)
        return location
    if location.startswith("s3://"):
        if not data:
            _put_empty_s3_object(location)
            return location
        with _s3().open(location, "wb") as handle:
            handle.write(data)
        return location
    from apache_beam.io.filesystem import CompressionTypes

    with _filesystems().create(location, compression_type=CompressionTypes.UNCOMPRESSED) as handle:
        handle.write(data)
    return location


def _put_empty_s3_object(location: str) -> None:
    """Beam's S3 writer always completes a multipart upload, and S3 refuses one with no parts (MalformedXML): an empty
    object is put in one request by boto3, configured as Beam's client is (environment and standard AWS settings)."""
    import boto3

    url = parse(location)
    boto3.session.Session().client("s3").put_object(Bucket=url.bucket, Key=url.key, Body=b"")


def upload(local: str | Path, location: str | Path) -> str:
    """Copies the local file to `location` in chunks (files larger than memory); a local target is written whole or
    not at all, an object appears when its upload completes."""
    location = _check(location)
    if not is_url(location):
        Path(location).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(location).with_name(f".{Path(location).name}.{uuid.uuid4().hex}.tmp")
        try:
            shutil.copyfile(local, tmp)
            os.replace(tmp, location)
        finally:
            tmp.unlink(missing_ok=True)
        return location
    if location.startswith("s3://"):
        if Path(local).stat().st_size == 0:
            _put_empty_s3_object(location)
            return location
        with open(local, "rb") as source, _s3().open(location, "wb") as out:
            shutil.copyfileobj(source, out, 8 * 1024 * 1024)
        return location
    from apache_beam.io.filesystem import CompressionTypes

    with open(local, "rb") as source, _filesystems().create(location, compression_type=CompressionTypes.UNCOMPRESSED) as out:
        shutil.copyfileobj(source, out, 8 * 1024 * 1024)
    return location


def exists(location: str | Path) -> bool:
    location = _check(location)
    if location.startswith("s3://"):
        return _s3().exists(location)
    return Path(location).exists() if not is_url(location) else _filesystems().exists(location)


def list_files(directory: str | Path) -> dict[str, int]:
    """Every file under `directory` (recursively), as relative POSIX name -> size in bytes."""
    directory = _check(directory)
    if not is_url(directory):
        root = Path(directory)
        if not root.is_dir():
            return {}
        return {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}
    prefix = directory.rstrip("/") + "/"
    if prefix.startswith("s3://"):
        return {path[len(prefix):]: size for path, size in sorted(_s3().list_files(prefix))}
    matched = _filesystems().match([prefix + "**"])[0].metadata_list
    return {m.path[len(prefix):]: m.size_in_bytes for m in sorted(matched, key=lambda m: m.path)}


def delete(locations: Iterable[str]) -> None:
    locations = [_check(loc) for loc in locations]
    local = [loc for loc in locations if not is_url(loc)]
    for loc in local:
        Path(loc).unlink(missing_ok=True)
    fs = _filesystems()
    s3 = [loc for loc in locations if loc.startswith("s3://")]
    if s3:
        failed = {loc: err for loc, err in _s3().delete_paths(s3).items() if err is not None}
        if failed:
            raise StorageError(f"cannot delete {sorted(failed)[:5]}: {next(iter(failed.values()))}")
    gs = [loc for loc in locations if loc.startswith("gs://")]
    if gs:
        # One request per object (Beam's GcsIO.delete), not FileSystems.delete's batch request: the google-cloud-storage
        # client sends batch parts without a Content-ID, which fake-gcs-server answers with no parts at all.
        from apache_beam.io.gcp.gcsio import GcsIO

        gcs = GcsIO(pipeline_options=fs._pipeline_options)
        for loc in gs:
            gcs.delete(loc)


# ----------------------------------------------------------------- sets --


@dataclass(frozen=True)
class OutputState:
    """What a set's output location holds before a run: nothing, a finished set (a manifest), or the files of an
    interrupted run (no manifest)."""

    location: str
    files: dict[str, int]

    @property
    def finished(self) -> bool:
        return MANIFEST_NAME in self.files

    @property
    def leftovers(self) -> list[str]:
        return [] if self.finished else sorted(self.files)

    def describe(self) -> str:
        if not self.files:
            return f"{self.location} is empty"
        if self.finished:
            return f"{self.location} holds a finished set ({MANIFEST_NAME} and {len(self.files) - 1} other files)"
        shown = ", ".join(self.leftovers[:5]) + (" ..." if len(self.leftovers) > 5 else "")
        return (
            f"{self.location} holds {len(self.files)} files and no {MANIFEST_NAME}: what an interrupted run "
            f"left behind ({shown})"
        )


def output_state(location: str | Path) -> OutputState:
    return OutputState(str(location), list_files(location))


def prepare_output(location: str | Path) -> OutputState:
    """Before a run writes a set to `location`: an empty location is used as it is; a finished set, or the files of an
    interrupted run (no manifest), are refused with what was found - never overwritten, mixed or deleted here."""
    state = output_state(location)
    if state.finished:
        raise StorageError(f"{state.describe()}; choose a new output location or delete the set first")
    if state.files:
        raise StorageError(f"{state.describe()}; delete them or choose a new output location")
    return state


def commit_files(local: Path, location: str | Path) -> None:
    """Uploads every file of the local set directory `local` to `location`, the manifest last, then checks that each
    is there at its size; a failure before the manifest leaves no manifest, so no reader takes the set."""
    files = list_files(local)
    if MANIFEST_NAME not in files:
        raise StorageError(f"{local}: no {MANIFEST_NAME}: not a finished set, nothing committed to {location}")
    for name in sorted(files):
        if name != MANIFEST_NAME:
            upload(local / name, join(location, name))
    present = list_files(location)
    wrong = [name for name, size in files.items() if name != MANIFEST_NAME and present.get(name) != size]
    if wrong:
        raise StorageError(f"{location}: {wrong[:5]} are missing or truncated after upload; no {MANIFEST_NAME} written")
    upload(local / MANIFEST_NAME, join(location, MANIFEST_NAME))


def fetch_set(location: str, sizes: dict[str, int], manifest: bytes, *, refresh: bool = False) -> Path:
    """A local copy of the set at URL `location`: the files `sizes` names (manifest already read by the caller), then
    `manifest` as MANIFEST_NAME, last, in a cache directory keyed by the URL (`$EMBER_CACHE_DIR/objects`, else
    `~/.cache/ember/objects`). A cached file of the expected size is kept unless `refresh`; callers verify the copy's
    sha256 against the manifest as for any local set. Several processes (ranks) share one copy: it is updated under
    a lock, and the manifest is removed before any file changes, so a copy with a manifest is always complete."""
    base = os.environ.get("EMBER_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ember"
    target = Path(base) / "objects" / hashlib.sha256(location.rstrip("/").encode()).hexdigest()[:32]
    target.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stale = [
            name for name, size in sizes.items()
            if refresh or not (target / name).is_file() or (target / name).stat().st_size != size
        ]
        current = target / MANIFEST_NAME
        if not stale and current.is_file() and current.read_bytes() == manifest:
            return target
        current.unlink(missing_ok=True)
        for name in stale:
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            write_atomically(target / name, read_bytes(join(location, name)), durable=False)
        write_atomically(current, manifest, durable=False)
    return target


# ------------------------------------------------------------ preflight --


def preflight(location: str | Path, *, write: bool = False) -> None:
    """Fails before any work, naming `location`: a typo in the URL, missing credentials, an unreachable endpoint, a
    missing bucket, or (with `write`) no permission to create and delete objects there. Local paths: the nearest
    existing directory must be writable (with `write`)."""
    location = str(location)
    if not is_url(location):
        if write:
            parent = Path(location).absolute()
            while not parent.exists():
                parent = parent.parent
            if not os.access(parent, os.W_OK):
                raise StorageError(f"{location}: {parent} is not writable")
        return
    url = parse(location)
    (_gcs_bucket if url.scheme == "gs" else _s3_bucket)(location, url.bucket)
    if write:
        probe = join(location, f"{PROBE_PREFIX}{uuid.uuid4().hex}")
        try:
            write_bytes(probe, b"ember")
            delete([probe])
        except Exception as exc:  # noqa: BLE001 - the client's own error, reported with the URL
            raise StorageError(f"{location}: cannot create and delete objects there ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def _gcs_bucket(location: str, bucket: str) -> None:
    import google.auth.exceptions
    from google.api_core import exceptions as gexc
    from google.cloud import storage

    try:
        client = storage.Client()
    except google.auth.exceptions.DefaultCredentialsError as exc:
        raise StorageError(
            f"{location}: no Google credentials (set GOOGLE_APPLICATION_CREDENTIALS or run "
            f"`gcloud auth application-default login`; STORAGE_EMULATOR_HOST for a local server): {_first_line(exc)}"
        ) from None
    endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "storage.googleapis.com"
    try:
        client.get_bucket(bucket, timeout=_TIMEOUT_S, retry=None)
    except gexc.NotFound:
        raise StorageError(f"{location}: bucket {bucket!r} does not exist at {endpoint}") from None
    except gexc.Forbidden as exc:
        raise StorageError(f"{location}: permission denied on bucket {bucket!r} ({_first_line(exc)})") from None
    except gexc.Unauthorized as exc:
        raise StorageError(f"{location}: credentials rejected ({_first_line(exc)})") from None
    except (gexc.GoogleAPIError, google.auth.exceptions.GoogleAuthError, OSError) as exc:  # requests' errors are OSErrors
        raise StorageError(f"{location}: storage endpoint {endpoint} unreachable ({_first_line(exc)})") from None


def _s3_bucket(location: str, bucket: str) -> None:
    import boto3
    import botocore.exceptions as bexc
    from botocore.config import Config

    client = boto3.session.Session().client(
        "s3", config=Config(connect_timeout=_TIMEOUT_S, read_timeout=_TIMEOUT_S, retries={"max_attempts": 1})
    )
    endpoint = client.meta.endpoint_url
    try:
        client.head_bucket(Bucket=bucket)
    except bexc.NoCredentialsError:
        raise StorageError(
            f"{location}: no AWS credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
        ) from None
    except bexc.ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchBucket"):
            raise StorageError(f"{location}: bucket {bucket!r} does not exist at {endpoint}") from None
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise StorageError(f"{location}: permission denied on bucket {bucket!r} (HTTP {code})") from None
        raise StorageError(f"{location}: {_first_line(exc)}") from None
    except (bexc.EndpointConnectionError, bexc.ConnectTimeoutError, bexc.ReadTimeoutError) as exc:
        raise StorageError(f"{location}: storage endpoint {endpoint} unreachable ({_first_line(exc)})") from None
    except bexc.BotoCoreError as exc:
        raise StorageError(f"{location}: {_first_line(exc)}") from None


def read_config_url(location: str, error: type[Exception]) -> bytes:
    """A config file's raw bytes at a gs:// or s3:// URL. Its bucket is checked first, so a typo, a missing bucket or
    missing credentials are named as such; any other failure names the URL. Failures raise `error` (the
    config's own error class)."""
    try:
        preflight(location)
        return read_bytes(location)
    except StorageError as exc:
        raise error(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - Beam wraps every filesystem failure in its own BeamIOError
        raise error(f"{location}: cannot read the config file: {exc}") from None
