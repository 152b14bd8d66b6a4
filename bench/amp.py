"""FP32 vs AMP training: throughput and activation memory on the same model and batch, as ratios, in one run.

Each measurement runs the trainer's own step (mpinfer.train: ``autocast_for`` + ``LossScaler`` + AdamW):
forward under autocast, cross-entropy, scaled backward, scaler step. For every model the FP32 run and the
AMP runs use the same weights, batch and step count, so the ratios compare like with like.

Memory, two measures:
* ``saved``: bytes of the tensors autograd saves for backward (the activations, deduplicated by storage),
  measured with ``torch.autograd.graph.saved_tensors_hooks``; device-independent, so it works on CPU.
* ``cuda``: ``torch.cuda.max_memory_allocated`` during the steps minus the baseline after the model,
  gradients and optimizer state exist (activation + workspace memory); CUDA only.

Goal on a GPU (issue 6): AMP >= 1.8x FP32 throughput and <= 0.6x activation memory, on a conv net and a
transformer. Usage::

    python bench/amp.py                         # CPU: bf16 vs fp32, small shapes
    python bench/amp.py --device cuda           # GPU: fp16 and bf16 vs fp32, larger shapes
    python bench/amp.py --json out/amp.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mpinfer.specs import Precision  # noqa: E402
from mpinfer.train.scaling import LossScaler  # noqa: E402
from mpinfer.train.trainer import autocast_for  # noqa: E402

# name -> (factory kwargs, batch, input builder) for each size; "large" sizes are where tensor cores pay off.
SIZES = {
    "tiny": {  # the CPU dry run of bench/gpu_check.sh (tests/test_gpu_check.py): plumbing, not speed
        "resnet": ({"width": 4}, 4, 16),
        "transformer": ({"dim": 32, "heads": 2, "depth": 1}, 4, 16),
    },
    "small": {
        "resnet": ({"width": 16}, 32, 64),
        "transformer": ({"dim": 128, "heads": 4, "depth": 2}, 16, 128),
    },
    "large": {
        "resnet": ({"width": 64}, 128, 64),
        "transformer": ({"dim": 512, "heads": 8, "depth": 6}, 64, 128),
    },
}


def build(name: str, size: str, device: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """Model, one input batch and labels."""
    kwargs, batch, extent = SIZES[size][name]
    g = torch.Generator().manual_seed(0)
    if name == "resnet":
        from models import resnet_small

        model = resnet_small.build(**kwargs)
        x = torch.randn(batch, 3, extent, extent, generator=g)
        y = torch.randint(0, resnet_small.NUM_CLASSES, (batch,), generator=g)
    else:
        from models import transformer_small

        model = transformer_small.build(**kwargs)
        x = torch.randint(0, transformer_small.VOCAB, (batch, extent), generator=g)
        y = torch.randint(0, 4, (batch,), generator=g)
    return model.to(device).train(), x.to(device), y.to(device)


def saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, autocast) -> int:
    """Bytes autograd keeps for backward in one forward (deduplicated by storage)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    del loss
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)  # weights are not activations


class Run:
    """One model + optimizer + scaler in one precision, steppable repeatedly."""

    def __init__(self, name: str, size: str, precision: Precision, device: str, warmup: int) -> None:
        self.name, self.precision, self.device = name, precision, device
        self.model, self.x, self.y = build(name, size, device)
        self.dev_type = device.split(":")[0]
        self.autocast = autocast_for(precision, self.dev_type)
        self.scaler = LossScaler(
            self.dev_type, enabled=precision is Precision.FP16, init_scale=2.0**16, min_scale=0.0
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.best_s = float("inf")
        self.cuda_activation_bytes = 0
        for _ in range(warmup):
            self.step()

    def step(self) -> None:
        with self.autocast():
            loss = torch.nn.functional.cross_entropy(self.model(self.x).float(), self.y)
        self.scaler.backward(loss)
        self.scaler.step(self.opt, step=0)
        self.opt.zero_grad(set_to_none=True)

    def time(self, steps: int) -> None:
        """Time ``steps`` steps; keep the best time over calls (least disturbed by other load)."""
        cuda = self.dev_type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated()  # weights, grads (None), optimizer state
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        if cuda:
            torch.cuda.synchronize()
            self.cuda_activation_bytes = max(
                self.cuda_activation_bytes, torch.cuda.max_memory_allocated() - baseline
            )
        self.best_s = min(self.best_s, time.perf_counter() - t0)

    def record(self, steps: int) -> dict:
        rec = {
            "model": self.name,
            "precision": self.precision.value,
            "batch": int(self.x.shape[0]),
            "steps": steps,
            "samples_per_s": steps * self.x.shape[0] / self.best_s,
            "saved_activation_bytes": saved_activation_bytes(self.model, self.x, self.y, self.autocast),
            "skipped_steps": self.scaler.skipped,
        }
        if self.dev_type == "cuda":
            rec["cuda_activation_bytes"] = self.cuda_activation_bytes
        return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--size", choices=list(SIZES), default=None, help="default: small on CPU, large on CUDA")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10 CPU / 50 CUDA)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per precision; the best is kept")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    cuda = device == "cuda"
    size = args.size or ("large" if cuda else "small")
    steps = args.steps or (50 if cuda else 10)
    lows = [Precision.FP16, Precision.BF16] if cuda else [Precision.BF16]
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # FP32 means FP32: TF32 would blur the baseline
        torch.backends.cudnn.allow_tf32 = False
    hw = (
        torch.cuda.get_device_name()
        if cuda
        else f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    )
    print(
        f"AMP vs FP32 training, {hw}, torch {torch.__version__}, size {size}, "
        f"best of {args.repeats} x {steps} steps"
    )
    rows = []
    for name in SIZES[size]:
        runs = [Run(name, size, p, device, args.warmup) for p in [Precision.FP32, *lows]]
        for _ in range(args.repeats):  # interleaved, so drifting load hits every precision alike
            for run in runs:
                run.time(steps)
        base = runs[0].record(steps)
        rows.append(base)
        for run in runs[1:]:
            rec = run.record(steps)
            rec["throughput_ratio"] = rec["samples_per_s"] / base["samples_per_s"]
            rec["saved_activation_ratio"] = rec["saved_activation_bytes"] / base["saved_activation_bytes"]
            if cuda:
                rec["cuda_activation_ratio"] = rec["cuda_activation_bytes"] / base["cuda_activation_bytes"]
            rows.append(rec)
        del runs
    header = f"{'model':12} {'prec':5} {'batch':>5} {'samples/s':>10} {'x fp32':>7} "
    header += f"{'saved act MiB':>13} {'x fp32':>7}"
    if cuda:
        header += f" {'cuda act MiB':>12} {'x fp32':>7}"
    print(header)
    for r in rows:
        line = (
            f"{r['model']:12} {r['precision']:5} {r['batch']:>5} {r['samples_per_s']:>10.1f} "
            f"{r.get('throughput_ratio', 1.0):>7.2f} {r['saved_activation_bytes'] / 2**20:>13.1f} "
            f"{r.get('saved_activation_ratio', 1.0):>7.2f}"
        )
        if cuda:
            line += (
                f" {r['cuda_activation_bytes'] / 2**20:>12.1f} {r.get('cuda_activation_ratio', 1.0):>7.2f}"
            )
        print(line)
    if cuda:
        goal = all(
            r["throughput_ratio"] >= 1.8 and r["cuda_activation_ratio"] <= 0.6
            for r in rows
            if r["precision"] != "fp32"
        )
        print(
            f"GPU goal (>= 1.8x throughput, <= 0.6x activation memory, every model and AMP dtype): "
            f"{'met' if goal else 'NOT met'}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": hw, "size": size, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
