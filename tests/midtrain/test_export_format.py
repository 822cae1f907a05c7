"""The policy export's one reader: what it checks, and that it loads the bytes it checked.

Every export here is written by the real exporter (`export_checkpoint`) from a real torch.distributed
checkpoint holding megatron's tensor names at their global shapes (what `midtrain rl` saves), without
megatron or a process group, so these tests take seconds. A test that needs an export whose files are
consistent with its manifest but wrong in content re-seals the edited files with the writer's own `seal`,
which stands for an exporter that wrote them.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from ember.midtrain.config import ModelConfig, MoEConfig
from ember.midtrain.export_format import (
    CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE, PolicyConfig, PolicyFetchError, read_export, seal, sha256,
)
from ember.midtrain.export_hf import Exported, export_checkpoint, hf_tensors
from ember.midtrain.hf_policy import load_policy

MODEL = ModelConfig(tokenizer="toy", vocab_size=16, seq_len=64, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2)
MOE = MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=32)


def _checkpoint_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The toy policy's megatron tensors (2 layers, hidden 32, 4 heads in 2 groups, 8 experts of 32)."""
    g = torch.Generator().manual_seed(seed)
    layers, hidden, experts, ffn, rows = 2, 32, 8, 32, 16
    qkv_rows = (4 + 2 * 2) * (hidden // 4)
    shapes = {
        "embedding.word_embeddings.weight": (rows, hidden),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (layers, hidden),
        "decoder.layers.self_attention.linear_qkv.weight": (layers, qkv_rows, hidden),
        "decoder.layers.self_attention.linear_proj.weight": (layers, hidden, hidden),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (layers, hidden),
        "decoder.layers.mlp.router.weight": (layers, experts, hidden),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (layers, experts, 2 * ffn, hidden),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (layers, experts, hidden, ffn),
        "decoder.final_layernorm.weight": (hidden,),
        "output_layer.weight": (rows, hidden),
    }
    return {name: torch.randn(shape, generator=g) * 0.2 for name, shape in shapes.items()}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Exported, dict[str, torch.Tensor]]:
    """One export of a real checkpoint, and the Mixtral tensors it must hold."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as save_checkpoint

    root = tmp_path_factory.mktemp("export-format")
    tensors = _checkpoint_tensors(seed=1)
    with warnings.catch_warnings():  # "torch.distributed is disabled ... a single process", which is the intent
        warnings.simplefilter("ignore", UserWarning)
        save_checkpoint(dict(tensors), storage_writer=FileSystemWriter(str(root / "step_00000004")), no_dist=True)
    done = export_checkpoint(root / "step_00000004", root / "version_4", MODEL, MOE, {"policy_version": 4, "step": 4})
    return done, hf_tensors(tensors, MODEL, MOE)


@pytest.fixture
def export(exported, tmp_path) -> Path:
    """A copy of the export for one test to alter."""
    return Path(shutil.copytree(exported[0].path, tmp_path / "version_4"))


def _reseal(path: Path, **files: bytes) -> str:
    """Rewrites the export's files (`config`, `weights`: new bytes for those) and its manifest consistently,
    as an exporter that wrote them would; returns the new digest."""
    names = {"config": CONFIG_FILE, "weights": WEIGHTS_FILE}
    current = {name: (path / name).read_bytes() for name in names.values()}
    current |= {names[key]: data for key, data in files.items()}
    source = json.loads((path / MANIFEST_FILE).read_text())["source_checkpoint"]
    return seal(path, current, Path(source))


def _config_with(path: Path, **changes) -> bytes:
    return json.dumps(json.loads((path / CONFIG_FILE).read_text()) | changes).encode()


def test_an_export_round_trips_through_the_loader_every_consumer_uses(exported):
    done, expected = exported
    assert sorted(p.name for p in done.path.iterdir()) == [CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE]
    manifest = json.loads((done.path / MANIFEST_FILE).read_text())
    assert done.sha256 == sha256((done.path / MANIFEST_FILE).read_bytes()), "the digest is the manifest's"
    assert manifest["format"] == 2 and (manifest["policy_version"], manifest["step"]) == (4, 4)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        data = (done.path / name).read_bytes()
        assert manifest["files"][name] == {"sha256": sha256(data), "size": len(data)}, f"{name} is pinned"
    policy = load_policy(done.uri, done.sha256)
    assert policy.weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(policy.weights[name], tensor), name
    config = policy.config
    assert (config.num_hidden_layers, config.num_key_value_heads, config.num_local_experts) == (2, 2, 8)
    assert config.parameter_count() == sum(t.numel() for t in expected.values())
    assert read_export(done.path).sha256 == done.sha256, "the trainer's re-announce path reads the same digest"
    logprobs = policy.token_logprobs([1, 5, 3, 9, 2, 11])
    assert logprobs[0] == 0 and all(-10 < lp < 0 for lp in logprobs[1:])


def test_the_weights_loaded_are_the_bytes_that_were_hashed_even_if_the_file_is_swapped_after_reading(exported, export):
    """The reader holds each file's bytes: replacing the file on disk after `read_export` (where a hash-then-
    reopen loader would load the replacement) changes nothing; the same swap before reading is refused."""
    done, expected = exported
    checked = read_export(export, done.sha256)
    impostor = save({name: torch.zeros_like(t) for name, t in expected.items()}, metadata={"format": "pt"})
    (export / WEIGHTS_FILE).write_bytes(impostor)
    _, tensors = checked.load()
    assert all(torch.equal(tensors[name], t) for name, t in expected.items()), "the checked weights, not the swapped ones"
    with pytest.raises(PolicyFetchError, match=rf"{WEIGHTS_FILE} hashes to {sha256(impostor)}, export.json records .*: the file changed"):
        read_export(export, done.sha256)


def test_an_edited_config_is_refused_whether_or_not_the_manifest_was_rewritten_to_match(exported, export):
    done = exported[0]
    hostile = _config_with(export, num_hidden_layers=2_000_000, rms_norm_eps=-1.0)
    (export / CONFIG_FILE).write_bytes(hostile)
    with pytest.raises(PolicyFetchError, match=rf"{CONFIG_FILE}: {len(hostile)} bytes, export.json records .*: the file changed"):
        load_policy(export.as_uri(), done.sha256)
    digest = _reseal(export, config=hostile)
    with pytest.raises(PolicyFetchError) as refused:
        load_policy(export.as_uri(), digest)
    message = str(refused.value)
    assert message.startswith(f"{export / CONFIG_FILE}: ") and "\n" not in message
    assert "num_hidden_layers: at most 1,024" in message and "(got 2000000)" in message
    assert "rms_norm_eps: Input should be greater than 0 (got -1.0)" in message


@pytest.mark.parametrize("changes, refusal", [
    ({"rope_theta": 0.0}, r"rope_theta: Input should be greater than 0 \(got 0.0\)"),
    ({"num_key_value_heads": 3}, "num_key_value_heads: 3 does not divide num_attention_heads 4"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok: 9 exceeds num_local_experts 8"),
    ({"sliding_window": 4096}, "sliding_window: Input should be None"),
    ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "rope_scaling: unknown key"),
    ({"intermediate_size": 4096}, r"describes 6,299,296 float32 parameters \(25,197,184 bytes\), .*model.safetensors holds .* bytes"),
    ({"vocab_size": 24, "intermediate_size": 16}, r"model.embed_tokens.weight is torch.float32 \[16, 32\], config.json says torch.float32 \[24, 32\]"),
    ({"torch_dtype": "bfloat16"}, r"model.embed_tokens.weight is torch.float32 \[16, 32\], config.json says torch.bfloat16"),
])
def test_a_config_the_weights_do_not_fit_or_the_forward_pass_cannot_honour_is_refused(export, changes, refusal):
    """Sealed as an exporter would: only the reader's own checks stand between this config and the forward pass.
    A config describing more parameters than the file holds is refused before the weights are parsed."""
    digest = _reseal(export, config=_config_with(export, **changes))
    with pytest.raises(PolicyFetchError, match=refusal):
        load_policy(export.as_uri(), digest)


def test_a_missing_or_unlisted_file_is_refused(exported, export):
    done = exported[0]
    (export / "tokenizer.json").write_text("{}")
    with pytest.raises(PolicyFetchError, match="tokenizer.json not listed in export.json; an export holds only the files it pins"):
        load_policy(export.as_uri(), done.sha256)
    (export / "tokenizer.json").unlink()
    (export / CONFIG_FILE).unlink()
    with pytest.raises(PolicyFetchError, match=f"{export / CONFIG_FILE}: missing from the export"):
        load_policy(export.as_uri(), done.sha256)
    with pytest.raises(PolicyFetchError, match="no such export directory"):
        load_policy((export.parent / "version_5").as_uri(), done.sha256)


def test_a_tampered_manifest_or_non_weights_file_is_refused(exported, export):
    done = exported[0]
    (export / CONFIG_FILE).write_bytes((export / CONFIG_FILE).read_bytes().replace(b"10000.0", b"10001.0"))
    with pytest.raises(PolicyFetchError, match=f"{CONFIG_FILE} hashes to .*: the file changed"):
        load_policy(export.as_uri(), done.sha256)
    manifest = json.loads((export / MANIFEST_FILE).read_text())
    manifest["files"][CONFIG_FILE]["sha256"] = sha256((export / CONFIG_FILE).read_bytes())  # "fixed" to match
    (export / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(PolicyFetchError, match=f"{MANIFEST_FILE} hashes to .*, the announcement says {done.sha256}: not the announced export"):
        load_policy(export.as_uri(), done.sha256)
    manifest["files"]["tokenizer.json"] = {"sha256": "0" * 64, "size": 2}
    (export / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(PolicyFetchError, match="files: must list exactly config.json, model.safetensors"):
        read_export(export)


def test_weights_that_grew_or_are_not_safetensors_are_refused(exported, export):
    done = exported[0]
    size = (export / WEIGHTS_FILE).stat().st_size
    with (export / WEIGHTS_FILE).open("ab") as handle:
        handle.write(b"\0")
    with pytest.raises(PolicyFetchError, match=f"{WEIGHTS_FILE}: over {size:,} bytes, export.json records {size:,}: the file changed"):
        load_policy(export.as_uri(), done.sha256)
    digest = _reseal(export, weights=b"\xff" * size)
    with pytest.raises(PolicyFetchError, match=f"{WEIGHTS_FILE}: not a safetensors file"):
        load_policy(export.as_uri(), digest)
    manifest = json.loads((export / MANIFEST_FILE).read_text())
    manifest["files"][WEIGHTS_FILE]["size"] = 2**50  # read as claimed, this would allocate a petabyte
    (export / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(PolicyFetchError, match=f"{WEIGHTS_FILE}: {size:,} bytes, export.json records {2**50:,}"):
        read_export(export)


def test_an_export_of_the_old_format_is_refused_with_how_to_fix_it(export):
    """Format 1 pinned the weights alone; its announcements carried the weights' sha256."""
    weights_sha256 = sha256((export / WEIGHTS_FILE).read_bytes())
    (export / MANIFEST_FILE).write_text(json.dumps({"weights": {WEIGHTS_FILE: weights_sha256}, "source_checkpoint": "/c"}))
    with pytest.raises(PolicyFetchError, match="export format 1, this reader takes formats 2 .* and 3 .*; re-export the checkpoint with `midtrain export-hf`"):
        read_export(export)
    with pytest.raises(PolicyFetchError, match="not the announced export"):
        load_policy(export.as_uri(), weights_sha256)


def test_the_policy_config_bounds_are_the_trainer_config_bounds():
    """Whatever `midtrain` accepts, the reader loads: a config at the trainer's upper bounds validates."""
    from ember.midtrain.export_hf import hf_config

    model = ModelConfig(tokenizer="t", vocab_size=4_194_304, seq_len=64, num_layers=1024, hidden_size=65_536, num_attention_heads=1024)
    moe = MoEConfig(num_experts=4096, router_topk=64, ffn_hidden_size=65_536)
    config = PolicyConfig.model_validate(hf_config(model, moe, 4_194_304, torch.bfloat16))
    assert config.parameter_count() > 10**15, "so the weights-size check, not allocation, is what refuses such a config"
