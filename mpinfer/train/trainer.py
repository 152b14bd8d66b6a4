"""The AMP trainer: autocast + GradScaler + accumulation + clipping + schedule + checkpoints + DDP/FSDP.

One optimizer step, in the order torch.amp prescribes::

    with autocast():                       # partial(torch.autocast, ...) or nullcontext for FP32
        loss = criterion(model(x), y)
    scaler.scale(loss / grad_accum).backward()       # per micro-batch (DDP: no_sync until the last)
    scaler.unscale_(optimizer); clip_grad_norm_(...) # only with clipping
    scaler.step(optimizer); scaler.update()          # skipped when the gradients hold Inf/NaN
    scheduler.step()                                  # only after an applied step

Checkpoints are written by rank 0 after every epoch; they carry everything a bit-exact resume needs. Under
``--strategy fsdp`` (see :mod:`mpinfer.train.sharded`) the model is sharded before the optimizer is built, every
rank writes its shards with DCP, and the gradient scaler all-reduces its Inf/NaN flag.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any

from mpinfer import __version__
from mpinfer.claim import claim_outputs
from mpinfer.errors import BackendUnavailableError, InvalidInputError, MpinferError, format_message
from mpinfer.fileio import make_dirs, write_json_atomic
from mpinfer.specs import Precision
from mpinfer.train import checkpoint as ck
from mpinfer.train import sharded
from mpinfer.train.config import DEFAULT_WARMUP_FRACTION, AmpConfig, TrainResult
from mpinfer.train.data import make_loader
from mpinfer.train.distributed import (
    DistContext,
    all_reduce_max,
    all_reduce_sums,
    barrier,
    broadcast_buffers,
    close_distributed,
    init_distributed,
)
from mpinfer.train.labels import check_labels, check_same_inputs, cross_entropy, num_classes
from mpinfer.train.metrics import best_index, peak_memory, summarize, write_metrics
from mpinfer.train.overflow import OverflowMonitor
from mpinfer.train.scaling import LossScaleCollapseError, LossScaler
from mpinfer.train.source import build_model, load_run_data

logger = logging.getLogger(__name__)

# Micro-batches between progress-bar refreshes (each one reads the loss back from the device).
PROGRESS_EVERY = 10
# Config fields whose change on resume breaks the bit-exact continuation.
EXACTNESS_FIELDS = (
    "data",
    "precision",
    "epochs",
    "batch_size",
    "lr",
    "weight_decay",
    "schedule",
    "warmup_steps",
    "grad_accum",
    "clip_grad_norm",
    "seed",
)


class TrainingDivergedError(MpinferError):
    """The loss became NaN/Inf without a loss scaler to absorb it."""


def lr_lambda(schedule: str, warmup: int, total: int) -> Any:
    """LR multiplier per optimizer step: linear warm-up, then cosine decay to 0 (or constant)."""

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


def autocast_for(precision: Precision, device_type: str) -> Any:
    """``partial(torch.autocast, device_type=..., dtype=...)`` for FP16/BF16, ``nullcontext`` for FP32."""
    import torch

    if not precision.is_low:
        return contextlib.nullcontext
    dtype = torch.float16 if precision is Precision.FP16 else torch.bfloat16
    return partial(torch.autocast, device_type=device_type, dtype=dtype)


def _forward(model: Any, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        out = model(**inputs)
    elif isinstance(inputs, (list, tuple)):
        out = model(*inputs)
    else:
        out = model(inputs)
    if isinstance(out, (list, tuple)):
        out = out[0]
    return getattr(out, "logits", out)


def _to_device(obj: Any, device: str) -> Any:
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj.to(device, non_blocking=True) if hasattr(obj, "to") else obj


class AmpTrainer:
    """Mixed-precision trainer for classification models (cross-entropy on integer labels).

    Args:
        config: The run configuration.

    Example:
        >>> result = AmpTrainer(AmpConfig("models/digits_cnn.py:build", Path("runs/d"),
        ...                               precision=Precision.BF16)).fit()
    """

    def __init__(self, config: AmpConfig) -> None:
        self.config = config
        self.dist = DistContext()
        self.model: Any = None  # the unwrapped nn.Module once fit() has set it up
        self.history: list[dict[str, Any]] = []
        self.start_epoch = 0
        self.global_step = 0
        self.micro_step = 0
        self.monitor: OverflowMonitor | None = None
        self._resume_rng: dict[str, Any] | None = None
        self._stale: list[Path] = []
        self._data_desc = ""
        self.strategy = "none"
        self._bytes: dict[str, int] | None = None

    # ----------------------------------------------------------------------------------------- public
    def fit(self, *, stop_after_epoch: int | None = None) -> TrainResult:
        """Train for ``config.epochs`` epochs (or stop after ``stop_after_epoch``, as an interruption would).

        Global RNG states are restored on return; the process group is destroyed if this call created it.

        Returns:
            Paths of the checkpoints, metrics and overflow report, and the summary.

        Raises:
            MpinferError: For bad input, and LossScaleCollapseError when FP16 scaling collapses.
        """
        with ck.preserved_global_rng():
            self.dist = init_distributed(self.config.device, fsdp=self.config.strategy == "fsdp")
            # the run folder is claimed (rank 0): a second run into it fails at once, naming this one
            claim = claim_outputs([self.config.output]) if self.dist.is_main else contextlib.nullcontext()
            try:
                with claim:
                    self._setup()
                    return self._run(stop_after_epoch)
            finally:
                if self.monitor is not None:
                    self.monitor.close()
                self.ddp = self.model  # the DDP wrapper's reducer holds the process group
                close_distributed(self.dist)

    # ------------------------------------------------------------------------------------------ setup
    def _setup(self) -> None:
        import torch

        cfg, dist = self.config, self.dist
        self._stale = ck.check_run_dir(cfg.output, force=cfg.force, resume=cfg.resume)
        ckpt = ck.load_checkpoint(cfg.resume) if cfg.resume is not None else None
        self._check_precision()
        ck.seed_everything(cfg.seed)
        model = build_model(cfg.model).to(dist.device)
        sharded.check_has_parameters(model)
        if ckpt is not None and cfg.resume is not None:  # another model's checkpoint: said before the data's fit
            ck.check_same_model(model.state_dict(), ckpt["model"], cfg.resume)
        ck.seed_everything(cfg.seed)  # factories often seed themselves; reseed for shuffling and dropout
        data, names = load_run_data(cfg.model, cfg.data, cfg.eval_data)
        classes = num_classes(model, data.train, lambda x: _forward(model, _to_device(x, dist.device)), names[0])
        if data.eval is not None:  # the eval set must fit the model too: found now, not after an epoch
            eval_classes = num_classes(model, data.eval, lambda x: _forward(model, _to_device(x, dist.device)),
                                       names[1])
            check_same_inputs(data, classes, eval_classes, names)
        check_labels(data, classes, names)
        self._data_desc = data.description
        loader_args = {"batch_size": cfg.batch_size, "seed": cfg.seed, "rank": dist.rank, "world": dist.world,
                       "num_workers": cfg.num_workers}
        self.train_loader = make_loader(data.train, shuffle=True, **loader_args)
        self.eval_loader = None if data.eval is None else make_loader(data.eval, shuffle=False, **loader_args)
        steps_per_epoch = math.ceil(len(self.train_loader) / cfg.grad_accum)
        total = steps_per_epoch * cfg.epochs
        warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(DEFAULT_WARMUP_FRACTION * total)
        self.strategy = cfg.strategy or ("ddp" if dist.distributed else "none")
        if self.strategy == "fsdp":  # the parameters become DTensor shards: the optimizer is built over those
            sharded.shard_model(model, cfg.precision, dist.device_type)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self._lr_fn = lr_lambda(cfg.schedule, warmup, total)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_fn)
        self.scaler = LossScaler(
            dist.device_type,
            enabled=cfg.precision is Precision.FP16,
            init_scale=cfg.init_scale,
            min_scale=cfg.min_loss_scale,
            sharded=self.strategy == "fsdp",
        )
        self.autocast = autocast_for(cfg.precision, dist.device_type)
        if ckpt is not None:
            self._restore(ckpt, model)
        self.model = model
        self.ddp = model
        if dist.distributed and self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [dist.local_rank] if dist.device_type == "cuda" else None
            self.ddp = DistributedDataParallel(model, device_ids=ids)
        if cfg.overflow_report and dist.is_main:
            self.monitor = OverflowMonitor(model, cfg.overflow_every)
        if dist.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats(dist.device)

    def _check_precision(self) -> None:
        import torch

        cfg, dev = self.config, self.dist.device_type
        if cfg.precision is Precision.FP16 and dev == "cpu":
            logger.warning(
                "fp16 on CPU: autocast runs few ops in FP16 there and is usually slower than FP32 (most CPUs "
                "have no FP16 arithmetic units); the GradScaler runs on CPU. Useful to test the FP16 path "
                "and collect overflow diagnostics; for speed on CPU use --precision bf16."
            )
        if cfg.precision is Precision.BF16 and dev == "cuda" and not torch.cuda.is_bf16_supported():
            raise BackendUnavailableError(
                format_message(
                    "Precision bf16",
                    f"a GPU without BF16 support ({torch.cuda.get_device_name()})",
                    "compute capability 8.0 or newer",
                    "use --precision fp16 on this GPU",
                )
            )

    def _restore(self, ckpt: dict[str, Any], model: Any) -> None:
        cfg = self.config
        assert cfg.resume is not None
        if "shards" in ckpt:  # an fsdp run's: DCP reshards to this run's layout (any world size, any strategy)
            sharded.load_shards(model, self.optimizer, cfg.resume.parent / ckpt["shards"], cfg.resume)
        elif self.strategy == "fsdp":  # a ddp or single-process run's full state, sharded here
            logger.info("resuming an unsharded checkpoint under fsdp: its state is sharded over %d process(es)",
                        self.dist.world)
            sharded.load_full_into_sharded(model, self.optimizer, ckpt)
        else:
            model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        # This run's --lr and --weight-decay apply from here on (the saved optimizer and schedule carry the old
        # ones), so the checkpoints it writes record the values it used; the LR of the next step follows this
        # run's schedule (identical to the saved one when nothing changed).
        self.scheduler.base_lrs = [cfg.lr for _ in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["initial_lr"], group["weight_decay"] = cfg.lr, cfg.weight_decay
            group["lr"] = cfg.lr * self._lr_fn(self.scheduler.last_epoch)
        self.scaler.load_state_dict(ckpt["amp_scaler"])
        self.history = [dict(r) for r in ckpt["metrics"]]
        self.start_epoch = int(ckpt["epoch"])
        self.global_step = int(ckpt.get("global_step", 0))
        self.micro_step = int(ckpt.get("micro_step", 0))
        self._resume_rng = ckpt["rng"]
        if self.start_epoch >= cfg.epochs:
            raise InvalidInputError(
                format_message(
                    f"Checkpoint '{cfg.resume}'",
                    f"a run that finished {self.start_epoch} epochs",
                    f"fewer than --epochs {cfg.epochs}",
                    "pass a larger --epochs to train further",
                )
            )
        now, then = cfg.to_dict(), dict(ckpt["config"])
        changed = [f"{k}: {then.get(k)!r} -> {now[k]!r}" for k in EXACTNESS_FIELDS if then.get(k) != now[k]]
        world_then = int(ckpt.get("world_size", 1))
        if world_then != self.dist.world:  # the samples per optimizer step are what a continued curve needs
            changed = [c for c in changed if not c.startswith("batch_size")]
            changed += ck.check_samples_per_step(int(then.get("batch_size", 0)), world_then, cfg.batch_size,
                                                 self.dist.world)
        if changed:
            logger.warning(
                "Resuming with changed settings (%s): the run will not match an uninterrupted one; "
                "the schedule continues from step %d with peak LR %g and weight decay %g.",
                "; ".join(changed),
                self.global_step,
                cfg.lr,
                cfg.weight_decay,
            )
        logger.info("resuming from %s after epoch %d", cfg.resume, self.start_epoch)

    # ------------------------------------------------------------------------------------------- loop
    def _run(self, stop_after_epoch: int | None) -> TrainResult:
        cfg, dist = self.config, self.dist
        out = cfg.output
        if dist.is_main:
            make_dirs(out, out)
            for p in self._stale:
                if p.is_dir():
                    shutil.rmtree(p)
                else:
                    p.unlink(missing_ok=True)
        if self._resume_rng is not None:
            ck.restore_rng(self._resume_rng)
        t_start = time.perf_counter()
        overflow_path = out / ck.OVERFLOW if self.monitor is not None else None
        logger.info("training %s on %s: %s, %s, epochs %d-%d, %d process(es)", cfg.to_dict()["model"],
                    self._data_desc, cfg.precision.value, dist.device, self.start_epoch + 1, cfg.epochs,
                    dist.world)
        self._epochs(stop_after_epoch, overflow_path)
        return self._finish(t_start, overflow_path)

    def _epochs(self, stop_after_epoch: int | None, overflow_path: Path | None) -> None:
        """Train (and evaluate, and checkpoint) epoch by epoch; the overflow report written on a collapse."""
        cfg, dist = self.config, self.dist
        with self._progress() as progress:
            for epoch in range(self.start_epoch, cfg.epochs):
                try:
                    rec = self._train_epoch(epoch, progress, overflow_path)
                except LossScaleCollapseError:
                    if self.monitor is not None and overflow_path is not None:
                        self.monitor.write(overflow_path, cfg.precision.value)
                    raise
                rec.update(self._evaluate())
                self.history.append(rec)
                self._save(epoch)  # every rank: an fsdp checkpoint is written by all of them
                barrier(dist)
                if stop_after_epoch is not None and epoch + 1 >= stop_after_epoch:
                    break

    def _finish(self, t_start: float, overflow_path: Path | None) -> TrainResult:
        """Log the end, write the overflow report and the summary; the result's paths."""
        cfg, dist = self.config, self.dist
        out = cfg.output
        done = self.history[-1]["epoch"] if self.history else 0
        logger.info("training done after epoch %d in %.1f s", done, time.perf_counter() - t_start)
        if self.monitor is not None and overflow_path is not None:
            self.monitor.write(overflow_path, cfg.precision.value)
        if self.history and sum(r["skipped_steps"] for r in self.history) >= self.history[-1]["step"] > 0:
            logger.warning(
                "Every optimizer step was skipped (non-finite gradients at every loss scale tried): the model "
                "was never updated, and best.pt holds its initial weights. Lower --init-scale, or check the "
                "model for values that overflow in %s.",
                cfg.precision.value,
            )
        summary = summarize(
            self.history,
            status="completed" if done >= cfg.epochs else "partial",
            extra={
                "precision": cfg.precision.value,
                "device": dist.device,
                "world_size": dist.world,
                "model": cfg.to_dict()["model"],
                "data": self._data_desc,
                "batch_size": cfg.batch_size,
                "grad_accum": cfg.grad_accum,
                "strategy": self.strategy,
                "rank_state_bytes": self.history[-1].get("rank_state_bytes") if self.history else None,
                "time_s": time.perf_counter() - t_start,
                "checkpoints": {"best": str(out / ck.BEST), "last": str(out / ck.LAST)},
                "overflow": str(overflow_path) if overflow_path is not None else None,
            },
        )
        if dist.is_main:

            write_json_atomic(out / ck.SUMMARY, summary)
        barrier(dist)
        return TrainResult(
            best=out / ck.BEST,
            last=out / ck.LAST,
            metrics=out / ck.METRICS,
            summary=summary,
            overflow=overflow_path,
        )

    def _progress(self) -> Any:
        if self.config.quiet or not self.dist.is_main:
            return contextlib.nullcontext(None)
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        return Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=Console(stderr=True),
        )

    def _train_epoch(self, epoch: int, progress: Any, overflow_path: Path | None) -> dict[str, Any]:
        import torch

        cfg, dist = self.config, self.dist
        self.ddp.train()
        self.train_loader.sampler.set_epoch(epoch)
        nb = len(self.train_loader)
        task = progress.add_task(f"epoch {epoch + 1}/{cfg.epochs}", total=nb, info="") if progress else None
        loss_sum = torch.zeros((), dtype=torch.float64, device=dist.device)
        bad = torch.zeros((), dtype=torch.int64, device=dist.device)
        seen = 0
        skipped_before, step_before = self.scaler.skipped, self.global_step
        self._bytes = None
        self.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        for i, (inputs, labels) in enumerate(self.train_loader):
            inputs, labels = _to_device(inputs, dist.device), labels.to(dist.device, non_blocking=True)
            boundary = (i + 1) % cfg.grad_accum == 0 or i + 1 == nb
            if self.monitor is not None:
                self.monitor.start_sample(self.micro_step)
            ddp = dist.distributed and self.strategy == "ddp"  # fsdp reduce-scatters every micro-batch
            sync = contextlib.nullcontext() if boundary or not ddp else self.ddp.no_sync()
            with sync:
                with self.autocast():
                    loss = cross_entropy(_forward(self.ddp, inputs).float(), labels)
                self.scaler.backward(loss / min(cfg.grad_accum, nb - i // cfg.grad_accum * cfg.grad_accum))
            finite = torch.isfinite(loss.detach())
            loss_sum += torch.where(finite, loss.detach().double(), 0.0) * labels.shape[0]
            bad += (~finite).long()
            seen += int(labels.shape[0])
            self.micro_step += 1
            if boundary:
                self._optimizer_step(overflow_path)
            if (i + 1) % PROGRESS_EVERY == 0 or i + 1 == nb:
                self._check_finite(bad)
                if task is not None:
                    progress.update(
                        task,
                        completed=i + 1,
                        info=f"loss {float(loss_sum) / max(seen, 1):.4f}"
                        f"  scale {self.scaler.scale:g}  skipped {self.scaler.skipped}",
                    )
        if self.monitor is not None:
            self.monitor.stop()
        if dist.device_type == "cuda":
            torch.cuda.synchronize(dist.device)
        elapsed = time.perf_counter() - t0
        broadcast_buffers(self.model, dist)
        total_loss, total_seen = all_reduce_sums([float(loss_sum), float(seen)], dist)
        mem, kind = peak_memory(dist.device)
        held = all_reduce_max(list(self._bytes.values()) if self._bytes else [0, 0, 0, 0], dist)
        return {
            "epoch": epoch + 1,
            "step": self.global_step,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "train_loss": total_loss / max(total_seen, 1.0),
            "loss_scale": self.scaler.scale,
            "skipped_steps": self.scaler.skipped - skipped_before,
            "samples_per_s": total_seen / max(elapsed, 1e-9),
            "epoch_time_s": elapsed,
            "step_time_s": elapsed / max(self.global_step - step_before, 1),
            # the largest of any rank, measured from the local tensors after the epoch's first optimizer step
            "rank_state_bytes": dict(zip(("parameters", "gradients", "optimizer", "total"), map(int, held))),
            "peak_memory_bytes": mem,
            "peak_memory_kind": kind,
        }

    def _optimizer_step(self, overflow_path: Path | None) -> None:
        import torch

        cfg = self.config
        if cfg.clip_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad_norm)
        outcome = self.scaler.step(self.optimizer, step=self.global_step, overflow_report=overflow_path)
        if self._bytes is None:  # gradients and optimizer state both exist now
            self._bytes = sharded.state_bytes(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if outcome.applied:
            self.scheduler.step()
        self.global_step += 1

    def _check_finite(self, bad: Any) -> None:
        if self.scaler.enabled or int(bad) == 0:
            return  # under FP16 the scaler skips such steps and lowers the scale
        raise TrainingDivergedError(
            format_message(
                f"Training loss became NaN/Inf by optimizer step {self.global_step}",
                f"{int(bad)} non-finite micro-batch losses",
                "finite losses",
                "lower --lr, add --clip-grad-norm 1.0, or check the data for extreme values",
            )
        )

    def _evaluate(self) -> dict[str, Any]:
        import torch

        if self.eval_loader is None:
            return {"eval_loss": None, "eval_accuracy": None}
        model, dev = self.model, self.dist.device
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        correct = torch.zeros((), dtype=torch.int64, device=dev)
        n = 0
        # fsdp all-gathers parameters in every forward: each rank runs as many as the one with most batches
        # (the evaluation shards differ by up to one sample), the extra ones on a batch whose result is dropped
        batches = len(self.eval_loader)
        rounds = int(all_reduce_max([float(batches)], self.dist)[0]) if self.strategy == "fsdp" else batches
        filler = None
        with torch.no_grad(), self.autocast():
            for inputs, labels in self.eval_loader:
                inputs, labels = _to_device(inputs, dev), labels.to(dev, non_blocking=True)
                logits = _forward(model, inputs).float()
                loss_sum += cross_entropy(logits, labels, reduction="sum").double()
                correct += (logits.argmax(dim=-1) == labels).sum()
                n += int(labels.shape[0])
                filler = inputs
            for _ in range(rounds - batches):
                if filler is None:  # no evaluation sample on this rank: one training sample as a batch
                    from torch.utils.data import default_collate

                    filler = _to_device(default_collate([self.train_loader.dataset[0]])[0], dev)
                _forward(model, filler)
        model.train()
        total_loss, total_correct, total = all_reduce_sums(
            [float(loss_sum), float(correct), float(n)], self.dist
        )
        return {"eval_loss": total_loss / max(total, 1.0), "eval_accuracy": total_correct / max(total, 1.0)}

    def _save(self, epoch: int) -> None:
        """Write last.pt (and best.pt, metrics.jsonl) on rank 0; under fsdp every rank writes its shards first."""
        out = self.config.output
        payload: dict[str, Any] = {
            LossScaler.state_dict_key: self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "epoch": epoch + 1,
            "global_step": self.global_step,
            "micro_step": self.micro_step,
            "rng": ck.capture_rng(),
            "config": self.config.to_dict(),
            "metrics": self.history,
            "mpinfer_version": __version__,
        }
        best_shards = sharded.shard_dir(self.history[best_index(self.history)]["epoch"])
        payload["world_size"] = self.dist.world
        if self.strategy == "fsdp":
            payload["shards"] = sharded.shard_dir(epoch + 1)
            sharded.save_shards(self.model, self.optimizer, out / payload["shards"])
            payload["model"] = sharded.full_model_state(self.model)  # for export: the whole FP32 model
        else:
            payload["model"], payload["optimizer"] = self.model.state_dict(), self.optimizer.state_dict()
        if not self.dist.is_main:
            return
        ck.save_checkpoint(out / ck.LAST, payload)
        if best_index(self.history) == len(self.history) - 1:
            ck.save_checkpoint(out / ck.BEST, payload)
        elif not (out / ck.BEST).exists():
            ck.carry_best(self.config.resume, out / ck.BEST, payload)
            if self.config.resume is not None and self.strategy == "fsdp":
                sharded.copy_shards(self.config.resume, best_shards, out)
        if self.strategy == "fsdp":
            sharded.prune_shards(out, [payload["shards"], best_shards])
        write_metrics(out / ck.METRICS, self.history)


def train_model(config: AmpConfig) -> TrainResult:
    """Train a model as ``config`` says; the API behind ``mpinfer train``.

    Args:
        config: The run configuration.

    Returns:
        Checkpoint, metrics and overflow-report paths plus the summary.
    """
    return AmpTrainer(config).fit()
