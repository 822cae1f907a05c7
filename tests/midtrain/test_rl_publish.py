"""Policy versions published full or as deltas (`rl.publish.VersionPublisher`), on disk and on the local object stores,
read back by the one reader (`export_format.read_export`) and the sampler's loader (`inference.policy.load_policy`).

The versions are real torch.distributed checkpoints in megatron's layout, each an Adam-like step (+-1e-5 on every
weight) from the last (tests/inference/support.py), exported by the real exporter.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import yaml

from ember import storage
from ember.configs import MidtrainConfigError
from ember.midtrain.config import parse_rl_config
from ember.inference.policy import load_policy
from ember.midtrain.export_format import (
    DELTA_FILE, MANIFEST_FILE, WEIGHTS_FILE, DeltaBaseUnavailable, PolicyFetchError, read_export,
)
from ember.midtrain.export_hf import export_checkpoint
from ember.midtrain.rl.publish import VersionPublisher
from tests.inference.support import EXAMPLE, consecutive_checkpoints, example_shape


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("publish")
    return root, consecutive_checkpoints(root / "checkpoints", 5)


@pytest.fixture(scope="module")
def full_exports(steps):
    """Each checkpoint exported in full: what a delta's rebuilt weights must equal byte for byte."""
    root, checkpoints = steps
    model, moe = example_shape()
    return [export_checkpoint(c, root / "full" / f"version_{i}", model, moe) for i, c in enumerate(checkpoints, 1)]


def _publisher(root, **options) -> VersionPublisher:
    model, moe = example_shape()
    return VersionPublisher(root, model, moe, **options)


def _weights_sha(exported) -> str:
    return hashlib.sha256(exported.files[WEIGHTS_FILE]).hexdigest()


def test_deltas_rebuild_the_bytes_of_a_full_export_and_every_kth_version_is_full(steps, full_exports, tmp_path):
    _, checkpoints = steps
    publisher = _publisher(tmp_path / "versions", full_every_k=3, keep_versions=5)
    published = [publisher.publish(c, i, i) for i, c in enumerate(checkpoints, 1)]
    assert [p.delta for p in published] == [False, True, True, False, True]
    for version, (done, full) in enumerate(zip(published, full_exports), 1):
        files = read_export(tmp_path / "versions" / f"version_{version}", done.sha256)
        assert _weights_sha(files) == json.loads((full.path / MANIFEST_FILE).read_text())["files"][WEIGHTS_FILE]["sha256"]
        assert files.files[WEIGHTS_FILE] == (full.path / WEIGHTS_FILE).read_bytes()
        assert files.manifest.policy_version == version
    full_bytes = sum(storage.list_files(full_exports[1].path).values())
    assert published[1].bytes < 0.75 * full_bytes, "a +-1e-5 step leaves most of each weight's bytes unchanged"


def test_a_late_sampler_walks_from_the_full_snapshot_and_a_missing_or_altered_base_is_refused_by_name(steps, tmp_path):
    _, checkpoints = steps
    versions = tmp_path / "versions"
    publisher = _publisher(versions, full_every_k=4, keep_versions=4)
    done = [publisher.publish(c, i, i) for i, c in enumerate(checkpoints[:3], 1)]
    late = load_policy((versions / "version_3").as_uri(), done[2].sha256, 3)  # rebuilt 1 -> 2 -> 3
    following = load_policy((versions / "version_2").as_uri(), done[1].sha256, 2)
    shutil.rmtree(versions / "version_1")
    walked = load_policy((versions / "version_3").as_uri(), done[2].sha256, 3, known=following)
    assert walked.files.files[WEIGHTS_FILE] == late.files.files[WEIGHTS_FILE], "a follower needs only the new delta"
    with pytest.raises(DeltaBaseUnavailable, match=r"version_3: a delta on version_2 .*version_2: a delta on version_1 .*no such export directory"):
        load_policy((versions / "version_3").as_uri(), done[2].sha256, 3)
    delta = versions / "version_3" / DELTA_FILE
    delta.write_bytes(delta.read_bytes()[:-1] + bytes([delta.read_bytes()[-1] ^ 1]))
    with pytest.raises(PolicyFetchError, match=rf"^{delta} hashes to [0-9a-f]{{64}}, export.json records .*: the file changed$"):
        load_policy((versions / "version_3").as_uri(), done[2].sha256, 3, known=following)


def test_a_delta_whose_rebuilt_tensor_differs_from_its_checksum_is_refused_naming_the_tensor(steps, tmp_path):
    """A delta and manifest rewritten to agree with each other (no announcement pins them) still must rebuild to the
    per-tensor checksums: here the delta of version 3 is applied to version 2's base."""
    _, checkpoints = steps
    versions = tmp_path / "versions"
    publisher = _publisher(versions, full_every_k=5, keep_versions=5)
    for i, c in enumerate(checkpoints[:3], 1):
        publisher.publish(c, i, i)
    manifest = json.loads((versions / "version_3" / MANIFEST_FILE).read_text())
    manifest["files"][DELTA_FILE] = json.loads((versions / "version_2" / MANIFEST_FILE).read_text())["files"][DELTA_FILE]
    shutil.copy(versions / "version_2" / DELTA_FILE, versions / "version_3" / DELTA_FILE)
    (versions / "version_3" / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(PolicyFetchError, match=r"weights.delta.zst: tensor \S+ rebuilds to sha256 [0-9a-f]{64}, export.json records"):
        read_export(versions / "version_3")


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_versions_published_to_an_object_store_load_in_the_sampler_with_the_trainers_digest(scheme, request, steps, full_exports, tmp_path):
    """Uploaded files first, export.json last; the sampler fetches the announced URI, rebuilds the delta from the
    store (no local copy) and verifies the trainer's sha256; versions beyond keep_versions leave the store."""
    _, checkpoints = steps
    bucket = request.getfixturevalue(f"{scheme}_bucket")
    publisher = _publisher(tmp_path / "versions", publish_uri=f"{bucket}/run", full_every_k=2, keep_versions=2)
    done = [publisher.publish(c, i, i) for i, c in enumerate(checkpoints[:4], 1)]
    assert [p.uri for p in done] == [f"{bucket}/run/version_{i}" for i in range(1, 5)]
    assert sorted({name.split("/")[0] for name in storage.list_files(f"{bucket}/run")}) == ["version_3", "version_4"]
    shutil.rmtree(tmp_path / "versions")  # the sampler reads the store only
    policy = load_policy(done[3].uri, done[3].sha256, 4)
    assert policy.sha256 == done[3].sha256 and policy.uri == f"{bucket}/run/version_4"
    assert policy.files.files[WEIGHTS_FILE] == (full_exports[3].path / WEIGHTS_FILE).read_bytes()
    with pytest.raises(PolicyFetchError, match=rf"^{bucket}/run/version_2/export.json: cannot be fetched"):
        load_policy(done[1].uri, done[1].sha256, 2)


@pytest.mark.parametrize(("rl", "refusal"), [
    ({"full_every_k": 4, "keep_versions": 2}, r"rl.keep_versions: 2 is below full_every_k 4"),
    ({"publish_uri": "ftp://bucket/run"}, r"rl.publish_uri: .*'ftp://bucket/run': expected gs://BUCKET/PREFIX or s3://BUCKET/PREFIX"),
])
def test_publishing_options_are_checked_naming_the_key(tmp_path, rl, refusal):
    data = yaml.safe_load(EXAMPLE.read_text())
    data["rl"].update(rl)
    with pytest.raises(MidtrainConfigError, match=refusal):
        parse_rl_config(data, tmp_path)
