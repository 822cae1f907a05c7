"""Wire codec: ember vs a zero-copy Arrow IPC anchor vs msgpack with memoryviews, on one realistic rollout.

The rollout: 8192 tokens, 4 turns, routed experts 61 layers x top-8 (uint8). Every codec encodes to
one message and decodes back to numpy arrays plus Python scalars. The anchors are the fastest fair
form of each library, without ember's checks:

- `arrow-zc`: one record batch of one row in an IPC stream; numpy arrays are wrapped (`pa.array` of a
  contiguous array shares its memory), the encoded stream is returned as Arrow's buffer (no copy into
  `bytes`), and decoding takes `to_numpy(zero_copy_only=True)` views of the message.
- `arrow-zc-bytes`: the same, with the encoded stream copied into `bytes` as ember's `encode` returns
  (a fresh multi-MB `bytes` costs its first-touch page faults; Arrow's pooled buffer does not).
- `msgpack-mv`: arrays packed as `bin` straight from memoryviews (no `tobytes()`); msgpack copies each
  `bin` into a `bytes` object on unpack, which `np.frombuffer` then views.

`ember` decodes and validates the record against its schema; `ember-noval` skips the schema checks
(structure, types and UTF-8 are still checked). Reported: message size, median MB/s of array payload
over --repeats runs, and ember's ratio to each anchor (>1 = ember faster). Timing never decides
pass/fail.

    .venv/bin/python bench/bench_codec.py [--repeats 200] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.rollouts.simulate import synthetic_rollout
from ember.schemas import decode, decode_rollout, encode_rollout
from ember.schemas.rollouts import Rollout

_ANCHOR_ARRAYS = ("tokens", "loss_mask", "sampler_logprobs")


def _one_row_list(array: np.ndarray) -> pa.LargeListArray:
    return pa.LargeListArray.from_arrays(pa.array([0, array.size], pa.int64()), pa.array(array.reshape(-1)))


def arrow_encode(rollout: Rollout) -> pa.Buffer:
    experts = rollout.routed_experts
    columns = {
        "rollout_id": pa.array([rollout.rollout_id]),
        "group_id": pa.array([rollout.group_id]),
        "prompt_id": pa.array([rollout.prompt_id]),
        "policy_version": pa.array([rollout.policy_version], pa.int64()),
        "sampler": pa.array([rollout.sampler]),
        "region": pa.array([rollout.region]),
        "created_at_us": pa.array([rollout.created_at_us], pa.int64()),
        "finish_reason": pa.array([rollout.finish_reason]),
        "truncated": pa.array([rollout.truncated]),
        "prompt_tokens": pa.array([rollout.prompt_tokens], pa.int64()),
        "turn_roles": pa.array([[t.role for t in rollout.turns]]),
        "turn_ends": pa.array([[t.end for t in rollout.turns]], pa.list_(pa.int32())),
        **{name: _one_row_list(getattr(rollout, name)) for name in _ANCHOR_ARRAYS},
        "routed_experts": _one_row_list(experts),
        "expert_shape": pa.array([list(experts.shape)], pa.list_(pa.int32())),
    }
    batch = pa.RecordBatch.from_pydict(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def arrow_decode(message: Any) -> dict[str, Any]:
    batch = pa.ipc.open_stream(message).read_next_batch()
    out: dict[str, Any] = {name: batch.column(name)[0].as_py() for name in ("rollout_id", "group_id", "prompt_id", "policy_version", "sampler", "region", "created_at_us", "finish_reason", "truncated", "prompt_tokens", "turn_roles", "turn_ends", "expert_shape")}
    for name in (*_ANCHOR_ARRAYS, "routed_experts"):
        out[name] = batch.column(name).flatten().to_numpy(zero_copy_only=True)
    out["routed_experts"] = out["routed_experts"].reshape(out.pop("expert_shape"))
    return out


def msgpack_encode(rollout: Rollout) -> bytes:
    experts = rollout.routed_experts
    return msgpack.packb(
        {
            "rollout_id": rollout.rollout_id,
            "group_id": rollout.group_id,
            "prompt_id": rollout.prompt_id,
            "policy_version": rollout.policy_version,
            "sampler": rollout.sampler,
            "region": rollout.region,
            "created_at_us": rollout.created_at_us,
            "turns": [[t.role, t.start, t.end] for t in rollout.turns],
            **{name: memoryview(getattr(rollout, name)).cast("B") for name in _ANCHOR_ARRAYS},
            "routed_experts": memoryview(experts).cast("B"),
            "experts_shape": list(experts.shape),
            "finish_reason": rollout.finish_reason,
            "truncated": rollout.truncated,
            "prompt_tokens": rollout.prompt_tokens,
        }
    )


def msgpack_decode(message: bytes) -> dict[str, Any]:
    data = msgpack.unpackb(message)
    data["tokens"] = np.frombuffer(data["tokens"], np.uint32)
    data["loss_mask"] = np.frombuffer(data["loss_mask"], np.uint8)
    data["sampler_logprobs"] = np.frombuffer(data["sampler_logprobs"], np.float32)
    data["routed_experts"] = np.frombuffer(data["routed_experts"], np.uint8).reshape(data["experts_shape"])
    return data


CODECS: dict[str, tuple[Callable[[Rollout], Any], Callable[[Any], Any]]] = {
    "ember": (encode_rollout, decode_rollout),
    "ember-noval": (encode_rollout, lambda m: decode(m, validate=False)),
    "arrow-zc": (arrow_encode, arrow_decode),
    "arrow-zc-bytes": (lambda r: arrow_encode(r).to_pybytes(), arrow_decode),
    "msgpack-mv": (msgpack_encode, msgpack_decode),
}


def seconds(fn: Callable[[Any], Any], arg: Any) -> float:
    start = time.perf_counter()
    fn(arg)
    return time.perf_counter() - start


def check_equal(rollout: Rollout, decoded: Any) -> None:
    """Every codec must give back the same arrays, or its timing means nothing."""
    get = decoded.get if isinstance(decoded, dict) else lambda name: getattr(decoded, name)
    for name in (*_ANCHOR_ARRAYS, "routed_experts"):
        assert np.array_equal(get(name), getattr(rollout, name)), name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="default: quick 30, full 200")
    parser.add_argument("--tokens", type=int, default=8192)
    add_flags(parser)
    args = parser.parse_args()
    repeats = args.repeats or profile_default(args.profile, 30, 200)
    rollout = synthetic_rollout(
        np.random.default_rng(0), group_id="g", prompt_id="p", num_tokens=args.tokens, layers=61, top_k=8, num_experts=256
    )
    payload_mb = sum(getattr(rollout, name).nbytes for name in (*_ANCHOR_ARRAYS, "routed_experts")) / 1e6
    messages, sizes = {}, {}
    for name, (enc, dec) in CODECS.items():
        messages[name] = enc(rollout)
        check_equal(rollout, dec(messages[name]))
        sizes[name] = len(messages[name])
    samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in CODECS}
    for _ in range(repeats):  # the codecs take turns, so a burst of load on the shared machine hits each alike
        for name, (enc, dec) in CODECS.items():
            samples[name][0].append(seconds(enc, rollout))
            samples[name][1].append(seconds(dec, messages[name]))
    results = {name: (sizes[name], statistics.median(e), statistics.median(d)) for name, (e, d) in samples.items()}
    print(f"rollout: {args.tokens} tokens, routed experts 61x8 uint8, array payload {payload_mb:.2f} MB, {repeats} repeats")
    print(f"{'codec':<15} {'bytes':>9} {'bytes/token':>11} {'encode MB/s':>12} {'decode MB/s':>12}")
    for name, (size, enc_s, dec_s) in results.items():
        print(f"{name:<15} {size:>9} {size / args.tokens:>11.2f} {payload_mb / enc_s:>12.0f} {payload_mb / dec_s:>12.0f}")
    size, ember_enc, ember_dec = results["ember"]
    _, _, noval_dec = results["ember-noval"]
    for name in ("arrow-zc", "arrow-zc-bytes", "msgpack-mv"):
        anchor_size, enc_s, dec_s = results[name]
        print(
            f"ember vs {name}: size {size - anchor_size:+d} B, encode {enc_s / ember_enc:.2f}x, "
            f"decode+validate {dec_s / ember_dec:.2f}x, decode {dec_s / noval_dec:.2f}x (>1 = ember faster)"
        )
    figures = [
        Figure(f"{what} MB/s vs {anchor}", "MB/s", payload_mb / results[ours][col], payload_mb / results[anchor][col],
               anchor, repeats=repeats)
        for anchor in ("arrow-zc", "msgpack-mv")
        for what, ours, col in (("encode", "ember", 1), ("decode+validate", "ember", 2), ("decode", "ember-noval", 2))
    ]
    write_results(args.results, "bench_codec", args.profile, figures, tokens=args.tokens, bytes=sizes)


if __name__ == "__main__":
    main()
