"""torch.distributed glue: one process per device under ``torchrun``, gloo on CPU, NCCL on CUDA.

``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; with ``WORLD_SIZE`` > 1 the trainer joins the
process group, wraps the model in ``DistributedDataParallel``, shards data with ``DistributedSampler`` and
lets rank 0 alone write checkpoints, metrics and progress bars.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from mpinfer.errors import BackendUnavailableError, format_message

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job.

    Attributes:
        rank: Global rank (0 when not distributed).
        world: Number of processes.
        local_rank: Rank on this machine (selects the CUDA device).
        device: ``"cpu"`` or ``"cuda:<local_rank>"``.
        owns_group: True when this context created the process group (and must destroy it).
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that writes files and shows progress."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True with more than one process."""
        return self.world > 1

    @property
    def device_type(self) -> str:
        """``"cuda"`` or ``"cpu"``."""
        return self.device.split(":")[0]


def resolve_device(device: str) -> str:
    """Map ``auto``/``cpu``/``cuda`` to an available device type.

    Raises:
        BackendUnavailableError: For ``cuda`` without a usable CUDA device.
    """
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError(
            format_message(
                "Device 'cuda'",
                "a machine where torch.cuda.is_available() is False",
                "a CUDA GPU",
                "use --device cpu (with --precision bf16 or fp32), or install a CUDA build of torch",
            )
        )
    return device


def init_distributed(device: str, *, fsdp: bool = False) -> DistContext:
    """Join the process group when launched by torchrun with ``WORLD_SIZE`` > 1.

    Args:
        device: ``auto``, ``cpu`` or ``cuda``.
        fsdp: FSDP needs a process group even for one process: without torchrun one is made in this process
            (nothing is sharded then, which is logged as a warning).

    Returns:
        The context; a single-process one without torchrun.
    """
    import torch

    device_type = resolve_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        dev = "cuda" if device_type == "cuda" else "cpu"
        return _single_process_group(dev) if fsdp else DistContext(device=dev)
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise BackendUnavailableError(
                format_message(
                    f"Local rank {local_rank}",
                    f"{torch.cuda.device_count()} CUDA devices",
                    "one device per process",
                    "lower --nproc_per_node to the number of GPUs",
                )
            )
        torch.cuda.set_device(local_rank)
    backend = "nccl" if device_type == "cuda" else "gloo"
    owns = not dist.is_initialized()
    if owns:
        # torch._dynamo, once imported (DDP's constructor does it), holds references to the process group that
        # exists at that moment until the interpreter exits; imported first, it holds none (see close_distributed)
        import torch._dynamo  # noqa: F401

        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    logger.info("distributed: rank %d/%d, backend %s", rank, world, backend)
    dev = f"cuda:{local_rank}" if device_type == "cuda" else "cpu"
    return DistContext(rank=rank, world=world, local_rank=local_rank, device=dev, owns_group=owns)


def _single_process_group(device: str) -> DistContext:
    """A one-process group (in-memory store) for FSDP without torchrun: the FSDP code path, nothing sharded."""
    import torch.distributed as dist

    logger.warning(
        "--strategy fsdp in one process (no torchrun, WORLD_SIZE 1): FSDP runs over a one-process group, so "
        "nothing is sharded and each tensor stays whole; launch with torchrun --nproc_per_node N to shard "
        "the model over N processes (checkpoints are the same sharded format, resumable at any world size)."
    )
    if dist.is_initialized():
        return DistContext(device=device, owns_group=False)
    import torch._dynamo  # noqa: F401  (see init_distributed)

    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistContext(device=device, owns_group=True)


def close_distributed(ctx: DistContext) -> bool:
    """Destroy the process group this context created, and see that torch's teardown of it happens now.

    A group that something still references is torn down while the interpreter exits instead, where gloo can
    abort the process ("terminate called without an active exception") after a finished run, and torchrun then
    fails the whole job. Free the DDP wrapper before calling this; its reducer holds the group.

    Returns:
        True when the group is gone (or this context created none); False when something still holds it.
    """
    if not ctx.owns_group:
        return True
    import gc
    import weakref

    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    gc.collect()  # a dropped DDP wrapper sits in reference cycles
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    released = group() is None
    if not released:
        logger.debug("the process group outlives destroy_process_group; torch tears it down at exit")
    return released


def all_reduce_sums(values: list[float], ctx: DistContext) -> list[float]:
    """Sum ``values`` over all processes (identity when not distributed)."""
    return _all_reduce(values, ctx, "SUM")


def all_reduce_max(values: list[float], ctx: DistContext) -> list[float]:
    """Element-wise maximum of ``values`` over all processes (identity when not distributed)."""
    return _all_reduce(values, ctx, "MAX")


def _all_reduce(values: list[float], ctx: DistContext, op: str) -> list[float]:
    if not ctx.distributed:
        return values
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return [float(v) for v in t.tolist()]


def barrier(ctx: DistContext) -> None:
    """Wait for every process (no-op when not distributed)."""
    if ctx.distributed:
        import torch.distributed as dist

        if ctx.device_type == "cuda":
            dist.barrier(device_ids=[ctx.local_rank])
        else:
            dist.barrier()


def broadcast_buffers(module: object, ctx: DistContext) -> None:
    """Copy rank 0's buffers (e.g. BatchNorm running statistics) to every rank.

    DDP broadcasts buffers at the start of each forward, so after the last training step every rank holds
    statistics updated by its own shard; this makes evaluation and checkpoints identical across ranks.
    """
    if not ctx.distributed:
        return
    import torch.distributed as dist

    for buf in module.buffers():  # type: ignore[attr-defined]
        dist.broadcast(buf, src=0)
