"""Additive attention masks: find the "minus infinity" constants and rewrite them to the low format's safe lowest.

Exporters build attention masks from float32's lowest value (``torch.finfo(torch.float32).min``, -3.4e38) or
from another huge negative number used as minus infinity (-1e9): ``Where(keep, 0, min)``,
``(1 - mask) * min``, or a constant causal-mask table. The mask is added to the attention scores just before
Softmax, where it drives the masked positions' probabilities to 0. Those values do not fit FP16, so a plain
conversion turns them into -inf (fully masked rows then give NaN) and the range rules keep the mask-add,
the Softmax and, through the cast they would need, the QK MatMul FP32 in every layer.

The values are rewritten instead, as ONNX Runtime's transformer tools and Optimum do, to the low format's
*safe lowest*:

* FP16: ``-FP16_MAX / RANGE_MARGIN`` = -32752. The range rules keep the scores within that same bound
  (``|score| * RANGE_MARGIN <= FP16_MAX``), so ``mask + score`` never overflows to -inf. A masked score lies
  at least ``32752 - 2 * absmax(scores)`` below its row's maximum; where calibration shows that gap is at least
  :data:`SOFTMAX_ZERO_GAP`, its probability rounds to exactly 0 in FP16 (and in float32) as before. Where it
  does not, the mask is left as it is (and stays FP32).
* BF16: BF16's lowest finite value, -3.3895e38 (float32's lowest rounds to -inf in BF16). Scores are far below
  half its spacing, so ``mask + score`` is the mask itself, exactly as in float32.

Only rows in which *every* position is masked (padding queries) change: float32's lowest absorbs the scores
and gives a uniform row, the safe lowest does not. Each rewrite is recorded in the plan on the node that
reads the constant (reason ``rewrite:mask``); a node the plan keeps FP32 keeps its original constant.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpinfer.precision.core import BF16_LOWEST, FLOAT, FP16_MAX, GraphInfo
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

# The same headroom as the range rules (rules.RANGE_MARGIN): scores may reach FP16_MAX / 2.
RANGE_MARGIN = 2.0
# FP16's safe lowest: mask + score stays finite for every score the range rules let run in FP16.
FP16_MASK_LOWEST = -FP16_MAX / RANGE_MARGIN
# A finite constant at or below this, added to the scores before a Softmax, is "minus infinity" (HF's
# older masks use -1e4, others -1e9 or float32's lowest).
MASK_SENTINEL = -1e4
# exp(-18) = 1.5e-8 < 2**-25, half FP16's smallest subnormal: a probability this far below its row's largest
# rounds to exactly 0 in FP16 (and exp(-104) would be needed for float32's subnormals, far inside the gap).
SOFTMAX_ZERO_GAP = 18.0
# Ops a mask passes through between its constant and the Add before the Softmax (element-wise and moves).
MASK_PATH_OPS = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Where",
        "Expand",
        "Reshape",
        "Slice",
        "Unsqueeze",
        "Squeeze",
        "Transpose",
        "Concat",
        "Identity",
        "Cast",
        "Min",
        "Max",
        "Tile",
        "Flatten",
    }
)
SOFTMAX_OPS = frozenset({"Softmax", "LogSoftmax"})
REASON = "rewrite:mask"


@dataclass(frozen=True)
class MaskSite:
    """A node that reads a "minus infinity" constant of an additive attention mask.

    Attributes:
        node: The address of the node that reads the constant.
        const: The constant's tensor name (initializer or Constant output).
        lowest: The constant's most negative finite value.
        value: The safe lowest value its out-of-range values become.
        softmax: Addresses of the Softmax nodes the mask reaches.
        tensors: The tensors that carry the mask, up to and including the Softmax inputs.
    """

    node: str
    const: str
    lowest: float
    value: float
    softmax: tuple[str, ...]
    tensors: frozenset[str]

    def detail(self, precision: Precision) -> str:
        """The plan's sentence for this rewrite."""
        return (
            f"additive attention mask: constant '{self.const}' holds {self.lowest:.4g} as minus infinity; rewritten "
            f"to {self.value:.6g} ({precision.value.upper()}'s safe lowest), so masked positions still get "
            f"probability 0 in {', '.join(self.softmax[:3])}"
            + (" ..." if len(self.softmax) > 3 else "")
        )


def safe_lowest(precision: Precision) -> float:
    """The value a mask's minus infinity becomes in ``precision`` (FP16 or BF16)."""
    return BF16_LOWEST if precision is Precision.BF16 else FP16_MASK_LOWEST


def find_mask_sites(
    info: GraphInfo, precision: Precision, stats: Mapping[str, Any] | None = None
) -> list[MaskSite]:
    """The mask constants of the main graph below ``precision``'s safe lowest, each at the node reading it.

    A constant already at the safe lowest (rewritten by an earlier call) is found again, so planning twice
    gives the same plan.

    Args:
        info: The graph.
        precision: The target low precision.
        stats: Calibration statistics; with them an FP16 site is kept only where the scores leave
            :data:`SOFTMAX_ZERO_GAP` between a masked position and its row's maximum.
    """
    if not precision.is_low:
        return []
    value = safe_lowest(precision)
    main = [ref for ref in info.nodes if "/" not in ref.address[: len(ref.address) - len(ref.node.name)]]
    feeds = _feeds_softmax(info, main)
    sites = []
    for ref in main:
        node = ref.node
        if node.op_type not in MASK_PATH_OPS or not any(o in feeds for o in node.output if o):
            continue
        for name in node.input:
            lowest = _sentinel(info, name, value)
            if lowest is None or not _only_read_by_mask_nodes(info, name, feeds):
                continue
            tensors, softmax, scores = _mask_path(info, ref.address, feeds)
            if not softmax:
                continue
            peak = _scores_peak(scores, stats)
            if precision is Precision.FP16 and peak is not None and 2 * peak + SOFTMAX_ZERO_GAP > -value:
                logger.warning(
                    "Attention mask '%s' kept as it is: the scores reach |%.4g|, too close to FP16's safe lowest %g "
                    "for masked positions to keep probability 0.",
                    name,
                    peak,
                    value,
                )
                continue
            sites.append(MaskSite(ref.address, name, lowest, value, tuple(softmax), frozenset(tensors)))
    return sites


def mask_tensors(sites: Iterable[MaskSite]) -> frozenset[str]:
    """Every tensor that carries a rewritten mask (their calibrated range is the mask's, not the data's)."""
    out: set[str] = set()
    for site in sites:
        out |= site.tensors
    return frozenset(out)


def rewrite_masks(info: GraphInfo, sites: Sequence[MaskSite], low_nodes: Iterable[str] | None = None) -> int:
    """Rewrite the sites' constants in ``info.model`` (in place) to their safe lowest values.

    Args:
        info: The graph whose model is rewritten (a model this process loaded, never a caller's).
        sites: From :func:`find_mask_sites`.
        low_nodes: Only the sites whose node is among these (the plan's low nodes); None = all.

    Returns:
        The number of constants rewritten.
    """
    wanted = None if low_nodes is None else set(low_nodes)
    done = set()
    for site in sites:
        if (wanted is not None and site.node not in wanted) or site.const in done:
            continue
        _replace_const(info, site.const, site.value)
        done.add(site.const)
    if done:
        logger.info("attention masks rewritten to their safe lowest value: %s", ", ".join(sorted(done)))
    return len(done)


def lowered(arr: np.ndarray, value: float) -> np.ndarray:
    """``arr`` with its finite values below ``value`` replaced by ``value`` (float32)."""
    a = np.asarray(arr, dtype=np.float32)
    return np.where(np.isfinite(a) & (a < np.float32(value)), np.float32(value), a).astype(np.float32)


def _replace_const(info: GraphInfo, name: str, value: float) -> None:
    from onnx import numpy_helper

    new = numpy_helper.from_array(lowered(info.const_array(name), value), name)  # type: ignore[arg-type]
    if name in info.initializers:
        info.initializers[name].CopyFrom(new)
        return
    node = info.by_address[info.producer[name]].node
    for attr in node.attribute:
        if attr.name == "value":
            new.name = attr.t.name
            attr.t.CopyFrom(new)
            return
    raise ValueError(f"Constant '{name}' has no tensor 'value' to rewrite")  # find_mask_sites checked it


def _feeds_softmax(info: GraphInfo, main: Sequence[Any]) -> set[str]:
    """Float tensors from which a Softmax input is reached through mask-path ops only."""
    feeds: set[str] = set()
    for ref in reversed(main):
        node = ref.node
        if node.op_type in SOFTMAX_OPS and node.input:
            feeds.add(node.input[0])
        elif node.op_type in MASK_PATH_OPS and any(o in feeds for o in node.output if o):
            feeds.update(n for n in node.input if n and info.types.get(n) == FLOAT)
    return feeds


def _sentinel(info: GraphInfo, name: str, value: float) -> float | None:
    """The most negative finite value of a float constant holding a mask's minus infinity below ``value``."""
    if not name or info.types.get(name) != FLOAT or not info.is_const(name):
        return None
    if name not in info.initializers and _constant_value_attr(info, name) is None:
        return None
    arr = info.const_array(name)
    if arr is None or arr.size == 0:
        return None
    finite = arr[np.isfinite(arr)]
    if not finite.size:
        return None
    lowest = float(finite.min())
    return lowest if lowest <= MASK_SENTINEL and lowest <= value else None  # (== value: rewritten already)


def _constant_value_attr(info: GraphInfo, name: str) -> Any:
    node = info.by_address[info.producer[name]].node
    return next((a for a in node.attribute if a.name == "value"), None)


def _only_read_by_mask_nodes(info: GraphInfo, name: str, feeds: set[str]) -> bool:
    """A constant shared with nodes outside any mask path is left alone (its other readers need its value)."""
    for addr, _ in info.consumers.get(name, []):
        node = info.by_address[addr].node
        if node.op_type not in MASK_PATH_OPS or not any(o in feeds for o in node.output if o):
            return False
    return True


def _mask_path(info: GraphInfo, start: str, feeds: set[str]) -> tuple[set[str], list[str], set[str]]:
    """(tensors carrying the mask from ``start`` on, the Softmaxes reached, the other inputs of the adds)."""
    tensors: set[str] = set()
    softmax: list[str] = []
    others: set[str] = set()
    todo = [start]
    seen = set()
    while todo:
        addr = todo.pop()
        if addr in seen:
            continue
        seen.add(addr)
        node = info.by_address[addr].node
        outs = [o for o in node.output if o and o in feeds]
        tensors.update(outs)
        for out in outs:
            for cons, _ in info.consumers.get(out, []):
                cnode = info.by_address[cons].node
                if cnode.op_type in SOFTMAX_OPS:
                    softmax.append(cons)
                elif cnode.op_type in MASK_PATH_OPS:
                    if cnode.op_type == "Add":
                        others.update(i for i in cnode.input if i and i != out and not info.is_const(i))
                    todo.append(cons)
    return tensors, sorted(set(softmax)), others - tensors


def _scores_peak(scores: set[str], stats: Mapping[str, Any] | None) -> float | None:
    if not stats or not scores:
        return None
    peaks = []
    for name in scores:
        st = stats.get(name)
        if st is None:
            continue
        val = st.get("absmax") if isinstance(st, Mapping) else getattr(st, "absmax", None)
        if val is not None:
            peaks.append(float(val))
    return max(peaks) if peaks else None
