"""Wire codec throughput: ember vs pyarrow IPC vs msgpack on one realistic rollout.

The rollout: 8192 tokens, 4 turns, routed experts 61 layers x top-8 (uint8). Each codec encodes to
bytes and decodes back to numpy arrays (msgpack carries arrays as raw `bin` buffers, its fastest
fair form; pyarrow uses a one-row IPC stream of the Rollout table). `ember` decodes and validates the
record against its schema; `ember-noval` skips validation, like the anchors (structure is still
checked). Reported: median MB/s over
--repeats runs and ember's ratio to each anchor. Timing never decides pass/fail.

    .venv/bin/python bench/bench_codec.py [--repeats 200] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import statistics
import time

import msgpack
import numpy as np
import pyarrow as pa

from ember.rollouts.simulate import synthetic_rollout
from ember.schemas import decode, decode_rollout, encode_rollout
from ember.schemas.rollouts import Rollout, rollouts_to_table, table_to_rollouts


def arrow_encode(rollout: Rollout) -> bytes:
    table = rollouts_to_table([rollout])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def arrow_decode(message: bytes) -> Rollout:
    return table_to_rollouts(pa.ipc.open_stream(message).read_all())[0]


def msgpack_encode(rollout: Rollout) -> bytes:
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
            "tokens": rollout.tokens.tobytes(),
            "loss_mask": rollout.loss_mask.tobytes(),
            "sampler_logprobs": rollout.sampler_logprobs.tobytes(),
            "routed_experts": rollout.routed_experts.tobytes(),
            "experts_shape": list(rollout.routed_experts.shape),
            "finish_reason": rollout.finish_reason,
            "truncated": rollout.truncated,
        }
    )


def msgpack_decode(message: bytes) -> dict:
    data = msgpack.unpackb(message)
    data["tokens"] = np.frombuffer(data["tokens"], np.uint32)
    data["loss_mask"] = np.frombuffer(data["loss_mask"], np.uint8)
    data["sampler_logprobs"] = np.frombuffer(data["sampler_logprobs"], np.float32)
    data["routed_experts"] = np.frombuffer(data["routed_experts"], np.uint8).reshape(data["experts_shape"])
    return data


CODECS = {
    "ember": (encode_rollout, decode_rollout),
    "ember-noval": (encode_rollout, lambda m: decode(m, validate=False)),
    "pyarrow-ipc": (arrow_encode, arrow_decode),
    "msgpack": (msgpack_encode, msgpack_decode),
}


def median_seconds(fn, arg, repeats: int) -> float:
    fn(arg)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(arg)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    rollout = synthetic_rollout(
        np.random.default_rng(0), group_id="g", prompt_id="p", num_tokens=args.tokens, layers=61, top_k=8, num_experts=256
    )
    payload_mb = sum(a.nbytes for a in (rollout.tokens, rollout.loss_mask, rollout.sampler_logprobs, rollout.routed_experts)) / 1e6
    results = {}
    for name, (enc, dec) in CODECS.items():
        message = enc(rollout)
        results[name] = (len(message), median_seconds(enc, rollout, args.repeats), median_seconds(dec, message, args.repeats))
    print(f"rollout: {args.tokens} tokens, routed experts 61x8 uint8, array payload {payload_mb:.2f} MB, {args.repeats} repeats")
    print(f"{'codec':<12} {'bytes/token':>11} {'encode MB/s':>12} {'decode MB/s':>12}")
    for name, (size, enc_s, dec_s) in results.items():
        print(f"{name:<12} {size / args.tokens:>11.1f} {payload_mb / enc_s:>12.0f} {payload_mb / dec_s:>12.0f}")
    _, ember_enc, ember_dec = results["ember"]
    _, _, noval_dec = results["ember-noval"]
    for name in ("pyarrow-ipc", "msgpack"):
        _, enc_s, dec_s = results[name]
        print(
            f"ember vs {name}: encode {enc_s / ember_enc:.2f}x, decode+validate {dec_s / ember_dec:.2f}x, "
            f"decode {dec_s / noval_dec:.2f}x (>1 = ember faster)"
        )


if __name__ == "__main__":
    main()
