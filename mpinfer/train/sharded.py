"""FSDP2 for the trainer: ``fully_shard`` with a mixed-precision policy, per-rank state bytes, DCP checkpoints.

``--strategy fsdp`` shards every block of the model, then the root, with
``torch.distributed.fsdp.fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32))``:
each rank keeps 1/world of the FP32 parameters (as ``DTensor`` shards), of their gradients and of the AdamW
state; a block's parameters are all-gathered in the run's precision just before its forward (and backward) and
freed after; gradients are reduce-scattered in FP32. Buffers (BatchNorm statistics) are not sharded.

Modules with floating-point buffers of their own (BatchNorm) are sharded on their own with FP32 parameters.
The blocks: the names listed by the model's ``fsdp_blocks`` attribute (paths as in ``named_modules()``), else
every direct child holding parameters; a ``ModuleList``/``ModuleDict`` (which has no forward of its own) stands
for its children.

Checkpoints of an FSDP run: ``torch.distributed.checkpoint`` (DCP) writes the sharded model and optimizer state
to ``shards/epoch-N/`` (one file per rank plus ``.metadata``); ``last.pt``/``best.pt`` hold everything else plus
``"shards"`` (that folder, relative to the ``.pt``) and ``"model"``, the full FP32 state_dict gathered on rank 0
(what ``mpinfer export --weights`` reads). DCP reshards on load, so a run resumes at any world size, with or
without FSDP.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.specs import Precision
from mpinfer.train.checkpoint import SHARDS

logger = logging.getLogger(__name__)

# The model attribute naming the modules to shard one by one (paths as in named_modules()).
BLOCKS_ATTRIBUTE = "fsdp_blocks"
# torch warns on every unscale_ that the scaler's 1-element found_inf tensor is replicated implicitly across
# the DTensor mesh, which is what it is meant to be (the scaler all-reduces it right after).
_FOUND_INF_WARNING = "Found a non-scalar tensor with numel=1"


def find_blocks(model: Any) -> list[str]:
    """Names of the submodules to shard one by one (the root is sharded after them).

    Args:
        model: The unwrapped ``nn.Module``.

    Returns:
        Module paths, in ``named_modules()`` order.

    Raises:
        InvalidInputError: For a model without parameters, or an ``fsdp_blocks`` entry it does not have.
    """
    from torch import nn

    check_has_parameters(model)
    modules = dict(model.named_modules())
    named = getattr(model, BLOCKS_ATTRIBUTE, None)
    if named is not None:
        missing = [n for n in named if n not in modules]
        if isinstance(named, str) or missing:
            raise InvalidInputError(
                format_message(
                    f"Model {type(model).__name__}: {BLOCKS_ATTRIBUTE}",
                    repr(named) if isinstance(named, str) else f"names it does not have ({', '.join(missing)})",
                    "a list of submodule paths as in named_modules(), e.g. ['blocks.0', 'blocks.1']",
                )
            )
        candidates = [(n, modules[n]) for n in named]
    else:
        candidates = list(model.named_children())
    blocks: list[str] = []
    for name, module in candidates:
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            blocks += [f"{name}.{child}" for child, m in module.named_children() if _has_params(m)]
        elif _has_params(module) and module is not model:
            blocks.append(name)
    return blocks


def check_has_parameters(model: Any) -> None:
    """Refuse a model without trainable parameters (nothing to train, nothing to shard).

    Raises:
        InvalidInputError: When no parameter requires a gradient.
    """
    if not any(p.requires_grad for p in model.parameters()):
        raise InvalidInputError(
            format_message(
                f"Model {type(model).__name__}",
                "no trainable parameters",
                "a model with parameters to train (and, under --strategy fsdp, to shard)",
                "the factory may return a module whose layers are not registered (a plain list instead of "
                "nn.ModuleList), or one whose parameters all have requires_grad=False",
            )
        )


def _has_params(module: Any) -> bool:
    return next(module.parameters(), None) is not None


def shard_model(model: Any, precision: Precision, device_type: str) -> list[str]:
    """``fully_shard`` the blocks of ``model``, then the root, in place.

    Args:
        model: The unwrapped module (its parameters become DTensor shards; build the optimizer after this).
        precision: Parameters are all-gathered in FP16/BF16 for low precisions, in FP32 otherwise.
        device_type: ``"cpu"`` or ``"cuda"``: the device mesh's type.

    Returns:
        The names of the sharded blocks.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = find_blocks(model)
    param_dtype = {Precision.FP16: torch.float16, Precision.BF16: torch.bfloat16}.get(precision)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    modules = dict(model.named_modules())
    fp32 = fp32_modules(model)  # sharded first (innermost), with a policy of their own
    for name in fp32:
        fully_shard(modules[name], mesh=mesh, mp_policy=MixedPrecisionPolicy(cast_forward_inputs=False))
    for name in blocks:
        if name not in fp32:
            fully_shard(modules[name], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    logger.info(
        "fsdp: %d block(s) + root sharded over %d process(es), parameters gathered in %s, gradients reduced "
        "in fp32", len(blocks), dist.get_world_size(), precision.value if param_dtype is not None else "fp32"
    )
    return blocks


def fp32_modules(model: Any) -> list[str]:
    """Modules whose parameters stay FP32: those with floating-point buffers of their own.

    BatchNorm's kernels want its weights and running statistics in one dtype; autocast runs it in FP32 under
    DDP too.
    """
    return [
        name
        for name, m in model.named_modules()
        if m is not model
        and any(True for _ in m.parameters(recurse=False))
        and any(b.is_floating_point() for b in m.buffers(recurse=False))
    ]


def local_bytes(t: Any) -> int:
    """Bytes this process holds for tensor ``t`` (a DTensor's local shard only)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


def state_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state, measured from the local tensors.

    Returns:
        ``{"parameters", "gradients", "optimizer", "total"}`` in bytes.
    """
    import torch

    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    opt = sum(
        local_bytes(v)
        for st in optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
    return {"parameters": params, "gradients": grads, "optimizer": opt, "total": params + grads + opt}


@contextlib.contextmanager
def quiet_found_inf() -> Iterator[None]:
    """Silence torch's per-step warning about the grad scaler's found_inf tensor on DTensor gradients."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_FOUND_INF_WARNING)
        yield


# ------------------------------------------------------------------------------------------- checkpoints
def shard_dir(epoch: int) -> str:
    """The DCP folder of an epoch, relative to the run folder."""
    return f"{SHARDS}/epoch-{epoch}"


def save_shards(model: Any, optimizer: Any, folder: Path) -> None:
    """Write the sharded model and optimizer state with DCP (collective: every rank calls it).

    The folder is written under a temporary name and renamed by rank 0 once every rank is done, so a folder
    with the final name is complete.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp = folder.with_name(folder.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)  # an epoch written again (a resumed run)
    dist.barrier()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        tmp.rename(folder)
    dist.barrier()


def full_model_state(model: Any) -> dict[str, Any]:
    """The full FP32 state_dict on CPU, gathered on rank 0 (empty on the others; collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_shards(model: Any, optimizer: Any, folder: Path, source: Path) -> None:
    """Load a DCP checkpoint into ``model`` and ``optimizer``, resharded to their layout (FSDP or not).

    Raises:
        InvalidInputError: When the folder is missing or unreadable.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (folder / ".metadata").is_file():
        raise InvalidInputError(
            format_message(
                f"Checkpoint '{source}'",
                f"a sharded checkpoint whose folder '{folder}' is missing or incomplete",
                "the shards folder written beside it by an fsdp run",
                "resume from the last.pt in the run folder it was written to, or copy that folder whole "
                f"(with {SHARDS}/)",
            )
        )
    msd, osd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": msd, "optimizer": osd}
    _single_process_dcp(lambda: dcp.load(state, checkpoint_id=str(folder)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _single_process_dcp(fn: Any) -> None:
    """Run a DCP call; without a process group DCP reads in this process alone (``no_dist``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        fn()
        return
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is meant
        warnings.filterwarnings("ignore", message=".*torch.distributed is.*")
        fn()


def load_full_into_sharded(model: Any, optimizer: Any, ckpt: dict[str, Any]) -> None:
    """Load a DDP/single-process checkpoint (full state_dicts, optimizer keyed by index) into an FSDP model.

    The optimizer was built over ``model.parameters()`` in the same order as the one that saved the checkpoint
    (both follow the model's definition), so index ``i`` is the ``i``-th parameter's name.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = [n for n, _ in model.named_parameters()]
    saved = ckpt["optimizer"]
    state = {names[int(i)]: st for i, st in saved["state"].items()}
    groups = [{**g, "params": [names[int(i)] for i in g["params"]]} for g in saved["param_groups"]]
    set_state_dict(
        model,
        optimizer,
        model_state_dict=ckpt["model"],
        optim_state_dict={"state": state, "param_groups": groups},
        options=StateDictOptions(full_state_dict=True),
    )


def prune_shards(run_dir: Path, keep: list[str]) -> None:
    """Remove the epoch folders under ``shards/`` that no checkpoint in ``keep`` points to (rank 0)."""
    root = run_dir / SHARDS
    if not root.is_dir():
        return
    kept = {(run_dir / k).resolve() for k in keep}
    for d in root.iterdir():
        if d.is_dir() and d.resolve() not in kept:
            shutil.rmtree(d, ignore_errors=True)


def copy_shards(src_ckpt: Path, rel: str, dest_run: Path) -> None:
    """Copy the shards folder a carried ``best.pt`` points to into the new run folder (rank 0)."""
    src, dest = src_ckpt.parent / rel, dest_run / rel
    if src.is_dir() and not dest.exists():
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        tmp.rename(dest)
