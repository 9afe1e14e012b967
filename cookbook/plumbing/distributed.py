"""Processes: the default process group and device, seeding, the per-rank share of a batch, the trainer ranks'
data-parallel × context-parallel groups, the weight-sync group between trainer rank 0 and the rollout ranks, and
the collectives the trainer steps use."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from jaxtyping import Bool
from torch import Tensor

from rlblocks.errors import ArgumentError
from rlblocks.sync import init_sync_group

T = TypeVar("T")


def setup_dist(*, threads: int | None = None, cpu: bool = False) -> tuple[int, int, torch.device]:
    """Join the default process group when started by ``torchrun`` (NCCL on GPUs, gloo on CPU); a plain
    ``python`` start is one process. Returns ``(rank, world, device)``; the device is ``cuda:LOCAL_RANK`` when CUDA
    is there (and ``cpu`` is false), else the CPU.

    CPU threads per process: ``threads`` when given; else ``OMP_NUM_THREADS`` when set (``torchrun`` sets 1 for
    several processes), else the cores split over the ranks (OpenMP threads that wait for each other on an
    oversubscribed CPU slow a tiny model down manyfold); one process keeps torch's default.
    """
    gpu = torch.cuda.is_available() and not cpu
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if gpu else "gloo", **_restart_store())
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if threads is not None:
        torch.set_num_threads(threads)
    elif world > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return rank, world, torch.device("cuda", torch.cuda.current_device())
    return rank, world, torch.device("cpu")


def _restart_store() -> dict[str, Any]:
    """The default group's store after a ``torchrun --max-restarts`` restart on one node.

    torchrun shares its rendezvous store with the workers (``TORCHELASTIC_USE_AGENT_STORE``), and the keys of the
    attempt that crashed are still in it: a rank that reads its peer's address from the old attempt fails to
    connect (gloo's ``connectFullMesh``, NCCL's unique id), and the restart is spent. On one node every worker has
    the same ``TORCHELASTIC_RESTART_COUNT``, so a prefix per attempt keeps the attempts apart. Over several nodes
    the counts can differ between agents: start torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` there (a new
    store per attempt), as torch recommends."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        print("setup_dist: a torchrun restart over several nodes with a shared rendezvous store may read the crashed "
              "attempt's keys; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun", flush=True)
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    return {"store": dist.PrefixStore(f"rlblocks/attempt-{restart}", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


def close_dist() -> None:
    """Leave the default process group (when there is one)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_rank(seed: int, rank: int) -> None:
    """Seed torch and Python's global ``random`` for this rank. The engines draw the sampling seed of every request
    that has none from the global ``random``, so without this a run of one seed does not repeat."""
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)


def prompts_per_rank(cfg: Any, world: int, rollout_ranks: int = 0) -> int:
    """``--prompts-per-step`` split over ``world`` trainer ranks (and, when given, over ``rollout_ranks`` rollout
    ranks too), refused when it does not divide or leaves fewer samples per trainer rank than ``--mini-batches``."""
    if cfg.prompts_per_step % world or (rollout_ranks and cfg.prompts_per_step % rollout_ranks):
        counts = (f"the trainer ({world}) and rollout ({rollout_ranks}) rank counts" if rollout_ranks
                  else f"the world size {world}")
        raise ArgumentError(f"--prompts-per-step: expected a multiple of {counts}, got {cfg.prompts_per_step}")
    n_local = cfg.prompts_per_step // world
    if cfg.mini_batches > n_local * cfg.group_size:
        raise ArgumentError(f"--mini-batches: expected at most the samples per rank ({n_local * cfg.group_size}), "
                            f"got {cfg.mini_batches}")
    return n_local


@dataclass(frozen=True)
class TrainerGroups:
    """This rank's place among the trainer ranks, grouped DP × CP (:func:`trainer_groups`).

    ``cp``: the context-parallel group (``None`` for ``--cp 1``): its ranks train the SAME samples, each forwarding
    a zigzag shard of every sequence, with ring attention between them. ``dp``: the data-parallel group (``None``:
    the caller's trainer group): one rank per CP index; the samples are split over it, and the loss normalisers
    (token and sequence counts) are summed over it. Gradients are reduced over all trainer ranks (FSDP2): each
    rank's covers its own tokens, so their sum is the gradient of the whole batch."""

    dp: Any
    cp: Any
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int


def trainer_groups(train_ranks: Sequence[int], cp: int, rank: int, *, train_group: Any = None) -> TrainerGroups:
    """The DP × CP groups of the trainer ranks ``train_ranks`` (global ranks, in order): trainer ``i`` is CP rank
    ``i % cp`` of CP group ``i // cp`` (consecutive ranks, so a CP group sits on one node's fast links) and DP rank
    ``i // cp``. ``train_group`` serves as the DP group when ``cp == 1``. Call it on EVERY rank of the world, in the
    same order (``new_group`` is collective); a rank outside ``train_ranks`` gets ``dp = cp = None``."""
    n = len(train_ranks)
    if cp < 1 or n % cp:
        raise ArgumentError(f"--cp: expected a divisor of the trainer rank count {n}, got {cp}")
    if cp == 1:
        i = list(train_ranks).index(rank) if rank in train_ranks else 0
        return TrainerGroups(train_group, None, i, n, 0, 1)
    mine = dict(dp=None, cp=None)
    for d in range(n // cp):  # every rank creates every group, in the same order
        ranks = list(train_ranks[d * cp : (d + 1) * cp])
        g = dist.new_group(ranks)
        mine["cp"] = g if rank in ranks else mine["cp"]
    for c in range(cp):
        ranks = list(train_ranks[c::cp])
        g = dist.new_group(ranks)
        mine["dp"] = g if rank in ranks else mine["dp"]
    i = list(train_ranks).index(rank) if rank in train_ranks else 0
    return TrainerGroups(mine["dp"], mine["cp"], i // cp, n // cp, i % cp, cp)


def gather_cp(items: list[T], groups: TrainerGroups) -> list[T]:
    """The items of every rank of this rank's CP group, concatenated in CP-rank order (the same list on each): the
    ranks of a CP group generate separate parts of one data-parallel share and then train on all of it."""
    if groups.cp is None:
        return items
    parts: list[Any] = [None] * groups.cp_size
    dist.all_gather_object(parts, items, group=groups.cp)
    return [x for part in parts for x in part]


def rank0_first(rank: int, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 first (it may build and cache a checkpoint), then on the others (they read the cache)."""
    out = fn() if rank == 0 else None
    if dist.is_initialized():
        dist.barrier()
    return out if rank == 0 else fn()


def pick_port(requested: int, rank: int) -> int:
    """A TCP port every rank agrees on: ``requested``, or (0) a free one picked by rank 0 and broadcast."""
    port = requested
    if rank == 0 and port == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    box = [port]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def join_sync_group(rank: int, n_train: int, world: int, port: int, *, backend: str = "gloo"):
    """The weight-sync group: trainer rank 0 (sync rank 0) and every rollout rank ``r`` (sync rank
    ``r − n_train + 1``), on its own TCPStore at ``port`` of ``MASTER_ADDR``. Call it on those ranks only."""
    return init_sync_group(master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"), master_port=port,
                           world_size=world - n_train + 1, rank=0 if rank == 0 else rank - n_train + 1,
                           backend=backend, timeout=600.0)


# ------------------------------------------------------------------------------------------------ collectives
def all_reduce(x: Tensor, op=None, group=None) -> Tensor:
    """All-reduce (SUM by default) over ``group`` when torch.distributed is up with more than one member."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=group)
    return x


def global_counts(mask: Bool[Tensor, "B T"], group=None, rows: Bool[Tensor, " B"] | None = None) -> dict[str, Tensor]:
    """Token count, sequence count and longest response over all trainer ranks (the aggregation normalisers), so
    the ranks' losses add up to the loss of the whole (mini-)batch. ``rows``: the rows that count as sequences
    (default all; a group failed for its reward stays in the batch, masked, and is no sequence of it)."""
    seqs = float(mask.shape[0]) if rows is None else float(rows.sum())
    sums = torch.tensor([float(mask.sum()), seqs], dtype=torch.float64)
    mx = torch.tensor([float(mask.sum(-1).max()) if mask.numel() else 0.0], dtype=torch.float64)
    all_reduce(sums, group=group)
    all_reduce(mx, op=dist.ReduceOp.MAX if dist.is_available() else None, group=group)
    dev = mask.device
    return {"tokens": sums[0].to(dev), "seqs": sums[1].to(dev), "max_len": mx[0].to(dev)}


def broadcast_flag(flag: bool, group=None, device: torch.device | None = None) -> bool:
    """Rank 0's ``flag`` on every rank of ``group`` (e.g. rank 0's clock decides when a run is done)."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return flag
    t = torch.tensor([int(flag)], device=device)  # on the device: NCCL moves CUDA tensors only
    dist.broadcast(t, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return bool(t.item())
