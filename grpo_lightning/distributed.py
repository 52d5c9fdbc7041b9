"""The few multi-process operations the rollout loop needs, written so one process needs no process group.

Rounds are sharded by prompt: rank r of W takes the r-th contiguous block of the round's prompts, so a group
(one prompt's rollouts) never spans ranks. Round metrics are computed from every rank's rollouts (gathered as
small summaries), not from rank 0's share. State that every rank keeps alike and updates from the round's results
(self-play's rated pool) is updated on every rank from every rank's results, in one order (`in_rank_order`).
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


def shard(items: list[T], rank: int, world_size: int) -> list[T]:
    """Rank `rank`'s contiguous block of `items` (len(items) must be a multiple of world_size)."""
    if len(items) % world_size:
        raise ValueError(f"cannot split {len(items)} items evenly over {world_size} processes")
    size = len(items) // world_size
    return items[rank * size : (rank + 1) * size]


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, in rank order (a one-element list on one process). Picklable objects only.

    `group`: the process group (None: the default one); a thread that runs beside the trainer passes its own."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def in_rank_order(items: Sequence[T], group: Any = None) -> list[T]:
    """Every rank's `items` in one sequence: rank 0's first, each rank's in its own order (on one process, `items`
    as a list). Every rank gets the same sequence, so state that every rank updates from all ranks' results, one
    result after another (self-play's ratings), stays identical on every rank when each applies it in this order;
    one process takes the same path with its own results. Picklable items only."""
    return [item for part in gather_objects(list(items), group) for item in part]


def sum_counts_across_ranks(counts: dict[str, float]) -> dict[str, float]:
    """Each of `counts` summed over ranks (every rank passes the same keys in the same order; a copy on one
    process). Summed as float64, so counts stay exact integers."""
    if not is_distributed():
        return dict(counts)
    totals = sum_across_ranks(torch.tensor(list(counts.values()), dtype=torch.float64))
    return dict(zip(counts, totals.tolist(), strict=True))


def sum_across_ranks(values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum over ranks of a CPU float64 tensor (identity on one process)."""
    if not is_distributed():
        return values
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    reduced = values.to(device)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced.cpu()


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from several integers or strings (stable across processes and Python runs)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted")
"""What a collective raises when another process of the run is gone (gloo's TCP pairs, NCCL's watchdog)."""


TIMED_OUT = (
    "Timed out waiting",
    "Application timeout caused pair closure",
    "Watchdog caught collective operation timeout",
)
"""What a collective raises when it waited longer than the process group's timeout (gloo's pairs, NCCL's
watchdog): the processes went out of step, or one stalled."""


def collective_timed_out(err: BaseException) -> bool:
    """Whether `err` is a collective, or the rendezvous of the process group, giving up after the group's timeout
    (`trainer.collective_timeout_s`, app/launch.py)."""
    if isinstance(err, dist.DistStoreError):
        return "timed out" in str(err).lower()
    return isinstance(err, RuntimeError) and any(s in str(err) for s in TIMED_OUT)


def group_timeout() -> datetime.timedelta | None:
    """The default process group's timeout (`trainer.collective_timeout_s`), for a process group made later:
    torch's `new_group` would take its own default instead. None without a process group, or where torch does not
    tell it."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    for device in ("cpu", "cuda"):
        try:
            return dist.group.WORLD._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def lost_a_process(err: BaseException) -> bool:
    """Whether `err` is a collective failing because another training process died (killed, out of memory):
    gloo notices a closed connection at once; NCCL after its timeout."""
    return isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and any(s in str(err) for s in PEER_LOST))
