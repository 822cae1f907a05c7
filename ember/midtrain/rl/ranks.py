"""RL batches across ranks: rank 0 reads each encoded batch, every rank decodes only its own share.

Why rank 0 alone reads: the ranks must train the same batch at every step and stop at the same one;
one reader hands out the next message (and the transport position it leaves behind), so the order
cannot differ between ranks and only one process commits the read position. What travels to the
other ranks is the encoded message; each decodes the rollouts `share_bounds` gives its data-parallel
rank (`rl_batch_share`), never the others' tokens or routed experts. A by-reference batch (what the
ETL writes) is a few hundred bytes: each rank fetches its own share's rollouts from Kafka (`fetch`).

Every poll round is one all-reduce on a gloo group: a stop signal on any rank ends the batches on all
of them at the same round, and an idle trainer still talks to its peers at each poll, so an idle wait
never runs into the process group's timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from ember.midtrain.rl.batch import RLBatch, RolloutSource, rl_batch_share
from ember.midtrain.runtime import StopRequest

_NOTHING, _BATCH, _END = 0, 1, 2


@dataclass(frozen=True)
class BatchMessage:
    """One encoded TrainBatch as the transport delivered it: where it was read, the position after it."""

    value: bytes
    offset: int | None = None
    position: dict[str, Any] | None = None


class RankBatches:
    """Iterates this rank's share of each batch. `messages` (rank 0 only; ignored elsewhere) yields a
    BatchMessage, or None when nothing arrived within one poll; it ends to end the batches."""

    def __init__(
        self, messages: Iterable[BatchMessage | None] | None, stop: StopRequest, group: Any, dp_rank: int, dp_size: int,
        fetch: RolloutSource | None = None,
    ):
        self.rank = dist.get_rank()
        if self.rank == 0 and messages is None:
            raise ValueError("rank 0 reads the batches: give it the message source")
        self.messages = iter(messages) if self.rank == 0 and messages is not None else None
        self.stop = stop
        self.group = group
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.fetch = fetch  # every rank reads its own share's rollouts of a by-reference batch

    def __iter__(self) -> Iterator[RLBatch]:
        while True:
            message = self._next_message()
            flags = torch.tensor(
                [float(self.stop.signal is not None), float(_NOTHING if message is None else _BATCH if message else _END)],
                dtype=torch.float64,
            )
            if self.rank != 0:
                flags[1] = 0
            dist.all_reduce(flags, group=self.group)
            if flags[0] > 0 or flags[1] == _END:
                return
            if flags[1] == _NOTHING:
                continue
            box = [message if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            read = box[0]
            yield rl_batch_share(
                read.value, self.dp_rank, self.dp_size, offset=read.offset, position=read.position, fetch=self.fetch
            )

    def _next_message(self) -> BatchMessage | None | bool:
        """Rank 0: the next message, None (nothing this poll) or False (the source ended); others: None."""
        if self.messages is None:
            return None
        return next(self.messages, False)
