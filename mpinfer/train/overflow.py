"""FP16 overflow diagnostics: which modules produce activations or gradients FP16 cannot hold.

Forward hooks on every leaf module measure, on sampled micro-batches, the share of output values above
FP16's largest finite value (65504, plus Inf/NaN) and of nonzero values below its smallest subnormal
(2**-24, which flush to zero), and the finite absmax. A tensor hook on each output records the same for the
gradient flowing back into it (as the backward pass sees it: multiplied by the loss scale under FP16).
Statistics stay on the device between samples, so sampling costs no host synchronisation.

The measurement is most telling in FP32 or BF16 training, where values FP16 could not hold are still
visible; under FP16 autocast overflow shows as Inf, while underflow has already become zero.

``overflow.json`` (``schema_version`` 1) lists in ``modules`` the flagged modules only (any overflow, or an
underflow share of at least :data:`UNDERFLOW_FLAG_FRACTION`), worst first; ``observed`` holds every module.
Gradient underflow is flagged only for FP16 runs: there gradients carry the loss scale, whereas the unscaled
gradients of an FP32/BF16 run underflow FP16 as a matter of course (the reason loss scaling exists).
``mpinfer convert --keep-fp32-from overflow.json`` keeps the ``activation`` entries' ONNX nodes in FP32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpinfer.fileio import write_json_atomic

logger = logging.getLogger(__name__)

# Largest finite FP16 value; anything larger becomes Inf.
FP16_MAX = 65504.0
# Smallest positive FP16 subnormal; nonzero magnitudes below it flush to zero.
FP16_MIN_SUBNORMAL = 2.0**-24
# An underflow share below 1% rarely moves a result (ReLU outputs and tiny gradients are normal); above it a
# module loses real information in FP16.
UNDERFLOW_FLAG_FRACTION = 0.01
KINDS = ("activation", "gradient")


@dataclass
class _Stat:
    type: str
    count: int = 0
    over: Any = 0
    under: Any = 0
    absmax: Any = 0.0
    steps: set[int] = field(default_factory=set)


class OverflowMonitor:
    """Per-module FP16 overflow/underflow statistics from forward and tensor hooks.

    Args:
        model: The (unwrapped) module to watch; names are its ``named_modules()`` paths.
        every: Sample one micro-batch in this many.
    """

    def __init__(self, model: Any, every: int) -> None:
        self.every = every
        self.active = False
        self._sample = -1
        self._sampled = 0
        self._stats: dict[tuple[str, str], _Stat] = {}
        self._handles = []
        for name, module in model.named_modules():
            if next(module.children(), None) is None:  # leaf modules: where the arithmetic happens
                self._handles.append(
                    module.register_forward_hook(self._make_hook(name or type(module).__name__))
                )

    def start_sample(self, micro_step: int) -> None:
        """Turn recording on for this micro-batch when it is a sampled one."""
        self.active = micro_step % self.every == 0
        if self.active:
            self._sample = micro_step
            self._sampled += 1

    def stop(self) -> None:
        """Turn recording off (e.g. for evaluation)."""
        self.active = False

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_hook(self, name: str) -> Any:
        def hook(module: Any, _args: Any, output: Any) -> None:
            if not self.active:
                return
            sample = self._sample
            for t in _float_tensors(output):
                self._record(name, type(module).__name__, "activation", t, sample)
                if t.requires_grad:
                    t.register_hook(
                        lambda g, n=name, m=type(module).__name__: self._record(n, m, "gradient", g, sample)
                    )

        return hook

    def _record(self, name: str, mtype: str, kind: str, t: Any, sample: int) -> None:
        import torch

        a = t.detach().float().abs()
        finite = torch.isfinite(a)
        st = self._stats.setdefault((name, kind), _Stat(mtype))
        st.count += a.numel()
        st.over = st.over + (~(a <= FP16_MAX)).sum()  # counts Inf and NaN too
        st.under = st.under + ((a > 0) & (a < FP16_MIN_SUBNORMAL)).sum()
        m = (
            torch.where(finite, a, torch.zeros_like(a)).amax()
            if a.numel()
            else torch.zeros((), device=a.device)
        )
        st.absmax = torch.maximum(torch.as_tensor(st.absmax, device=a.device), m)
        st.steps.add(sample)

    def entries(self) -> list[dict[str, Any]]:
        """One record per (module, kind) seen, in the contract's form."""
        out = []
        for (name, kind), st in self._stats.items():
            n = max(st.count, 1)
            out.append(
                {
                    "module": name,
                    "type": st.type,
                    "kind": kind,
                    "overflow_frac": float(st.over) / n,
                    "underflow_frac": float(st.under) / n,
                    "absmax": float(st.absmax),
                    "steps": len(st.steps),
                }
            )
        return out

    def report(self, precision: str) -> dict[str, Any]:
        """The ``overflow.json`` document."""
        observed = self.entries()
        flagged = [
            e
            for e in observed
            if e["overflow_frac"] > 0
            or (
                e["underflow_frac"] >= UNDERFLOW_FLAG_FRACTION
                and (e["kind"] == "activation" or precision == "fp16")
            )
        ]
        flagged.sort(key=lambda e: (-e["overflow_frac"], -e["underflow_frac"], e["module"], e["kind"]))
        return {
            "schema_version": 1,
            "precision": "fp16",
            "trained_in": precision,
            "sample_every": self.every,
            "sampled_steps": self._sampled,
            "thresholds": {
                "overflow_abs": FP16_MAX,
                "underflow_abs": FP16_MIN_SUBNORMAL,
                "underflow_flag_fraction": UNDERFLOW_FLAG_FRACTION,
            },
            "modules": flagged,
            "observed": observed,
        }

    def write(self, path: Path, precision: str) -> Path:
        """Write ``overflow.json`` atomically; log the flagged modules once."""
        doc = self.report(precision)
        write_json_atomic(path, doc)
        if doc["modules"]:
            names = sorted({e["module"] for e in doc["modules"]})
            logger.warning(
                "FP16 overflow/underflow in %d module(s): %s (details in %s)",
                len(names),
                ", ".join(names[:8]) + (" ..." if len(names) > 8 else ""),
                path,
            )
        return path


def _float_tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _float_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _float_tensors(o)]
    return []
