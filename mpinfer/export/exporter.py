"""``export_onnx``: torch model → checked ONNX model with a parity record.

Order of work (nothing is published until every check passed): load the model, resolve input specs, run the
torch model on the parity inputs (seeded inputs of several shapes; a decoder's prefill and decode steps), export
(dynamo first, TorchScript fallback under ``auto``), free the torch model, name every node, write the model once
into the output's staging folder, full ``onnx.checker``, parity of ONNX Runtime on that file against the torch
outputs, then publish ``<name>.onnx`` (with ``<name>.onnx.data``) and ``<name>.export.json`` together.

At model size: the torch model and the ONNX model are never both in memory with ONNX Runtime's session; the
TorchScript exporter writes the graph alone and the weights are streamed from the torch model to external data
(:mod:`mpinfer.export.streaming`: never a copy of them in a proto, never the whole model serialized), and a model
whose weights come to :data:`EXTERNAL_WEIGHTS_BYTES` or more keeps them in ``<name>.onnx.data`` (the exporter's
data file moved there), a smaller one embedded.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer import __version__
from mpinfer.claim import claim_outputs
from mpinfer.data.feeds import random_batch
from mpinfer.errors import AccuracyMismatchError, ExportError, InvalidInputError, format_message
from mpinfer.export.kv import decoder_opset, with_kv_cache
from mpinfer.export.loader import LoadedModel, bind_hf_inputs, check_forward_inputs, load_model, split_source
from mpinfer.export.outputs import flatten_outputs
from mpinfer.export.parity import ParityReport, compare_parity, parity_reference
from mpinfer.export.streaming import adopt_external_data, export_torchscript_streamed, release_dynamo_weights
from mpinfer.export.tidy import drop_noop_casts
from mpinfer.fileio import check_output_path, write_json_atomic
from mpinfer.modelio import (
    data_file,
    default_opset,
    load_onnx,
    name_nodes,
    save_onnx,
    save_streamed,
    uses_external_data,
    weight_bytes,
)
from mpinfer.specs import TensorSpec, parse_tensor_spec

logger = logging.getLogger(__name__)

EXPORTERS = ("auto", "dynamo", "torchscript")
# Opset for the TorchScript exporter when none is asked for: the newest it supports well (torch 2.x).
DEFAULT_TORCHSCRIPT_OPSET = 17
# Models whose weights come to at least this many bytes are written with external data (streamed, one tensor at a
# time): ONNX Runtime and every later step (convert, compare) then memory-map them instead of parsing them.
EXTERNAL_WEIGHTS_BYTES = 1_000_000_000
_OP_RE = re.compile(r"\b((?:aten|prim|[a-z_][a-z0-9_]*)::[A-Za-z0-9_]+|aten\.[A-Za-z0-9_]+(?:\.[a-z]+)?)")


@dataclass(frozen=True)
class ExportConfig:
    """What to export and how.

    Attributes:
        source: ``file.py[:factory]``, TorchScript file, ``.pt2`` program or Hugging Face folder.
        output: Destination ``.onnx`` path.
        weights: state_dict / trainer checkpoint for a factory source.
        inputs: Input specs (``name:dims:dtype[:lo..hi]``); default: the source's ``INPUT_SPECS``.
        dynamic: Symbols that stay dynamic (default: every symbol in the specs).
        exporter: ``auto`` (dynamo, then TorchScript), ``dynamo`` or ``torchscript``.
        opset: ONNX opset (default: the exporter's).
        force: Overwrite an existing output.
        atol: Parity absolute tolerance.
        rtol: Parity relative tolerance.
        parity_runs: Number of seeded parity inputs (shapes vary across the dynamic range).
        trust_weights: Load weights with ``weights_only=False``.
        output_names: Names for the model outputs (default: the source's ``OUTPUT_NAMES`` or output_<i>).
        past: Export a Hugging Face causal LM with its KV cache (``past_key_values.*`` in, ``present.*`` out) when
            no ``inputs`` are given; False exports ``input_ids, attention_mask -> logits``.
    """

    source: str
    output: Path
    weights: Path | None = None
    inputs: tuple[str, ...] = ()
    dynamic: tuple[str, ...] | None = None
    exporter: str = "auto"
    opset: int | None = None
    force: bool = False
    atol: float = 1e-4
    rtol: float = 1e-3
    parity_runs: int = 3
    trust_weights: bool = False
    output_names: tuple[str, ...] = ()
    past: bool = True


@dataclass
class ExportResult:
    """What export wrote and measured."""

    path: Path
    sidecar: Path
    exporter: str
    opset: int
    parity: ParityReport
    fallback_reason: str | None = None
    input_specs: list[TensorSpec] = field(default_factory=list)


def sidecar_path(output: Path) -> Path:
    """``out/model.onnx`` → ``out/model.export.json``."""
    return output.with_name((output.name[:-5] if output.name.endswith(".onnx") else output.name) + ".export.json")


def resolve_specs(loaded: LoadedModel, inputs: Sequence[str], dynamic: Sequence[str] | None) -> list[TensorSpec]:
    """Input specs from the CLI, else the source's INPUT_SPECS, else its example inputs (all fixed).

    Raises:
        InvalidInputError: If no spec can be found, or ``dynamic`` names an unknown symbol.
    """
    specs = [parse_tensor_spec(s) for s in (inputs or loaded.input_specs)]
    if not specs and loaded.example_inputs is not None:
        names = loaded.input_names or [f"input_{i}" for i in range(len(loaded.example_inputs))]
        for name, t in zip(names, loaded.example_inputs):
            dtype = str(t.dtype).replace("torch.", "")
            specs.append(parse_tensor_spec(f"{name}:{'x'.join(map(str, t.shape)) or 'scalar'}:{dtype}"))
    if not specs:
        raise InvalidInputError(format_message(f"Model '{loaded.description}'", "no input specs",
                                               "--input name:dims:dtype for each input",
                                               "or define INPUT_SPECS / example_inputs() in the model file"))
    if dynamic is None:
        return specs
    return _with_dynamic(specs, dynamic)


def _with_dynamic(specs: list[TensorSpec], dynamic: Sequence[str]) -> list[TensorSpec]:
    """``specs`` with every symbolic dim outside ``dynamic`` fixed at its example size.

    Raises:
        InvalidInputError: ``dynamic`` names a symbol no spec has.
    """
    symbols = {s for spec in specs for s in spec.symbols}
    unknown = [d for d in dynamic if d not in symbols]
    if unknown:
        raise InvalidInputError(format_message(f"--dynamic {', '.join(unknown)}", "symbols not in the input specs",
                                               f"one of {sorted(symbols) or 'none (specs are all fixed)'}",
                                               "write the dim symbolically in --input, e.g. x:batchx3x64x64:float32"))
    fixed = []
    for spec in specs:
        shape = tuple(d if isinstance(d, int) or d in dynamic else spec.concrete_shape()[i]
                      for i, d in enumerate(spec.shape))
        fixed.append(TensorSpec(spec.name, shape, spec.dtype, spec.value_range, spec.dim_sizes))
    return fixed


def _to_torch(batch: dict[str, np.ndarray], specs: Sequence[TensorSpec]) -> tuple[Any, ...]:
    import torch

    return tuple(torch.from_numpy(np.ascontiguousarray(batch[s.name])) for s in specs)


@contextlib.contextmanager
def _quiet_torch_onnx() -> Iterator[None]:
    """Silence the exporters' chatter, Python and C++ alike; it goes to the log at debug level."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile(mode="w+b") as sink, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = []
        try:
            for fd in (1, 2):
                try:
                    saved.append((fd, os.dup(fd)))
                    os.dup2(sink.fileno(), fd)
                except OSError:  # no real fd (e.g. under a test runner's capture): nothing to redirect
                    pass
            with contextlib.redirect_stdout(io.StringIO()):
                yield
        finally:
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)
            for lg, lv in zip(loggers, levels):
                lg.setLevel(lv)
            sink.seek(0)
            chatter = sink.read().decode("utf-8", "replace")
            if chatter.strip():
                logger.debug("exporter output:\n%s", chatter)


def _dynamic_shapes(specs: Sequence[TensorSpec], kv: Any) -> Any:
    """``dynamic_shapes`` for torch.export: each input's symbolic dims by name, in the forward's argument structure.

    A KV-cache wrapper takes its cache as ``*past`` (:mod:`mpinfer.export.kv`): those inputs' dims go in one tuple.
    """
    dyn = tuple({i: d for i, d in enumerate(s.shape) if isinstance(d, str)} for s in specs)
    if not any(dyn):
        return None
    if kv is not None:
        fixed = len(kv.input_names) - len(kv.past_names)
        return (*dyn[:fixed], tuple(dyn[fixed:]))
    return dyn


def _export_dynamo(module: Any, args: tuple[Any, ...], specs: Sequence[TensorSpec], out_names: Sequence[str],
                   opset: int | None, tmp: Path, kv: Any = None) -> Path:
    import torch

    is_program = isinstance(module, torch.export.ExportedProgram)
    dyn = None if is_program else _dynamic_shapes(specs, kv)
    with _quiet_torch_onnx():
        # a decoder: onnxscript's graph optimizer without its opset-23 fusions, which would write RotaryEmbedding
        # (no TensorRT before 10.15 parses it) and RMSNormalization without a name convert knows: convert fuses
        # the norm chains itself (mpinfer.precision.graph.fusion), the rotary arithmetic stays plain ops
        prog = torch.onnx.export(module, args, dynamo=True, input_names=[s.name for s in specs],
                                 output_names=list(out_names), dynamic_shapes=dyn, opset_version=opset,
                                 optimize=kv is None, verbose=False, report=False)
        if kv is not None:
            import onnxscript.optimizer

            onnxscript.optimizer.optimize_ir(prog.model)  # type: ignore[union-attr]
    path = tmp / "dynamo.onnx"
    with _quiet_torch_onnx():
        prog.save(str(path), external_data=True)  # type: ignore[union-attr]
    release_dynamo_weights(prog)
    return path


def _export_torchscript(module: Any, args: tuple[Any, ...], specs: Sequence[TensorSpec],
                        out_names: Sequence[str], opset: int | None, tmp: Path,
                        out_axes: dict[str, dict[int, str]] | None = None) -> Path:
    import torch

    if isinstance(module, torch.export.ExportedProgram):
        raise ExportError("The TorchScript exporter cannot take a torch.export program. Hint: use --exporter dynamo.")
    axes = {s.name: {i: d for i, d in enumerate(s.shape) if isinstance(d, str)} for s in specs}
    axes = {k: v for k, v in axes.items() if v} | {k: v for k, v in (out_axes or {}).items() if k in out_names}
    path = tmp / "torchscript.onnx"
    with _quiet_torch_onnx():  # the graph alone from the exporter, the weights streamed to its data file
        export_torchscript_streamed(module, args, path, input_names=[s.name for s in specs],
                                    output_names=list(out_names), dynamic_axes=axes or None,
                                    opset_version=opset or DEFAULT_TORCHSCRIPT_OPSET, do_constant_folding=True)
    return path


_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
_OP_PATTERNS = (
    re.compile(r"op='([^']+)'"),  # dynamo: No ONNX function found for <OpOverload(op='ns.name', ...)>
    re.compile(r"torch\.ops\.([A-Za-z0-9_]+\.[A-Za-z0-9_]+)"),
    _OP_RE,
)
_REASON_MARKERS = ("No ONNX function", "unrecognized namespace", "Unsupported", "not supported", "is not implemented")


def _explain(err: BaseException, exporter: str) -> str:
    """One line naming the failing op (when one can be found) and the exporter's reason."""
    chain: list[str] = []
    e: BaseException | None = err
    while e is not None and len(chain) < 5:
        chain.append(_ANSI_RE.sub("", f"{type(e).__name__}: {e}"))
        e = e.__cause__ or e.__context__
    text = "\n".join(chain)
    op = next((m.group(1) for pat in _OP_PATTERNS for m in [pat.search(text)] if m), None)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    reason = next((ln for ln in lines if any(k in ln for k in _REASON_MARKERS)), lines[0] if lines else "")
    reason = re.sub(r"^.*?'>: ", "", reason)[:300].rstrip(". ")
    op_part = f" on op {op}" if op else ""
    return f"the {exporter} exporter failed{op_part}: {reason}"


def _run_exporters(cfg: ExportConfig, loaded: LoadedModel, args: tuple[Any, ...], specs: Sequence[TensorSpec],
                   out_names: Sequence[str], tmp: Path) -> tuple[Path, str, str | None]:
    order = ["dynamo", "torchscript"] if cfg.exporter == "auto" else [cfg.exporter]
    import torch

    if loaded.kind == "torchscript" or isinstance(loaded.module, torch.jit.ScriptModule):
        order = ["torchscript"]  # a ScriptModule can only go through the TorchScript exporter
    failures: list[str] = []
    opset = cfg.opset if cfg.opset is not None or loaded.kv is None else decoder_opset()
    for name in order:
        start = time.perf_counter()
        logger.info("exporting with the %s exporter", name)
        try:
            if name == "dynamo":
                path = _export_dynamo(loaded.module, args, specs, out_names, opset, tmp, loaded.kv)
            else:
                path = _export_torchscript(loaded.module, args, specs, out_names, cfg.opset, tmp, loaded.output_axes)
        except ExportError:
            raise
        except Exception as err:  # exporters raise a zoo of types
            failures.append(_explain(err, name))
            logger.info("%s", failures[-1])
            logger.debug("exporter traceback", exc_info=True)
            continue
        produced = onnx_opset(path)
        if cfg.opset is not None and produced != cfg.opset:
            # dynamo builds opset 18+ and down-converts with onnx's version converter, keeping 18 when that fails
            failures.append(f"the {name} exporter produced opset {produced}, not the requested --opset {cfg.opset} "
                            "(it builds opset 18 or newer and could not convert this model to the older opset)")
            logger.info("%s", failures[-1])
            continue
        logger.info("%s export took %.1f s", name, time.perf_counter() - start)
        return path, name, ("; ".join(failures) or None)
    other = {"dynamo": "torchscript", "torchscript": "dynamo"}
    hint = (f"try --exporter {other[order[0]]}" if len(order) == 1 and loaded.kind != "torchscript"
            else "rewrite the op with supported torch ops, or register an ONNX translation for it")
    if cfg.opset is not None and any("not the requested --opset" in f for f in failures):
        hint = f"{hint}, or ask for a newer --opset (the dynamo exporter writes 18 or newer)"
    if loaded.kv is not None:
        hint = f"{hint}, or export the model without its KV cache (--no-past)"
    raise ExportError(f"Export of '{cfg.source}' failed: " + "; ".join(failures) + f". Hint: {hint}.")


def onnx_opset(path: Path) -> int:
    """The default-domain opset of the ONNX file at ``path`` (0 when it imports none)."""
    import onnx

    return default_opset(onnx.load(str(path), load_external_data=False))


def _name_output_dims(model: Any, out_axes: dict[str, dict[int, str]]) -> None:
    """Give the outputs' symbolic dims the names of ``out_axes`` (dynamo writes ``past + seq`` for ``total``)."""
    for vi in model.graph.output:
        dims = vi.type.tensor_type.shape.dim
        for i, name in out_axes.get(vi.name, {}).items():
            if i < len(dims) and not dims[i].HasField("dim_value"):
                dims[i].dim_param = name


def _post_process(path: Path, specs: Sequence[TensorSpec], description: str, exporter: str,
                  out_axes: dict[str, dict[int, str]] | None = None) -> Any:
    """The exported graph, nodes named and mpinfer's metadata set; external weights stay in their file."""
    import onnx

    model = name_nodes(load_onnx(path, load_external_data=False))
    _name_output_dims(model, out_axes or {})
    drop_noop_casts(model)
    ranges = {s.name: list(s.value_range) for s in specs if s.value_range is not None}
    # the sizes the specs give their symbolic dims (seq=16, samples=16000): random data for convert and compare
    # uses them instead of guessing (a speech model fed 2 audio samples rejects them)
    sizes = {k: int(v) for s in specs for k, v in s.dim_sizes.items()}
    keep = [p for p in model.metadata_props if not p.key.startswith("mpinfer.")]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    for key, value in (("mpinfer.input_ranges", json.dumps(ranges)), ("mpinfer.dim_sizes", json.dumps(sizes)),
                       ("mpinfer.exporter", exporter), ("mpinfer.source", description)):
        model.metadata_props.append(onnx.StringStringEntryProto(key=key, value=value))
    return model


def _write_model(model: Any, staged: Path, data_name: str, source_dir: Path) -> Path:
    """Write the exported model once, at ``staged``.

    Its weights go to ``data_name`` beside it when they come to :data:`EXTERNAL_WEIGHTS_BYTES` or more (the
    exporter's own data file moved there when it holds them all, else streamed tensor by tensor), embedded
    otherwise. ``source_dir``: where the exporter's own external data is (read tensor by tensor).
    ``model`` may be left without its weights: the caller drops it.
    """
    if weight_bytes(model) >= EXTERNAL_WEIGHTS_BYTES:
        if adopt_external_data(model, source_dir, staged, data_name):
            logger.info("the exporter's weight file moved to %s", data_name)
            return staged
        logger.info("writing the weights to %s, one tensor at a time", data_name)
        return save_streamed(model, staged, data_name, base_dir=source_dir)
    if uses_external_data(model):
        from onnx.external_data_helper import load_external_data_for_model

        load_external_data_for_model(model, str(source_dir))
    return save_onnx(model, staged)


def _check_config(cfg: ExportConfig) -> None:
    if cfg.exporter not in EXPORTERS:
        raise InvalidInputError(format_message("--exporter", repr(cfg.exporter), " | ".join(EXPORTERS)))
    for flag, value in (("--atol", cfg.atol), ("--rtol", cfg.rtol)):
        if not value >= 0:  # also refuses NaN
            raise InvalidInputError(format_message(f"Parity tolerance {flag}", value, "a number >= 0",
                                                   "0 demands exact equality; the defaults are --atol 1e-4 "
                                                   "--rtol 1e-3"))


def _check_outputs(cfg: ExportConfig) -> tuple[Path, Path]:
    """Check every path export writes (model, sidecar, external data) before any work; return model, sidecar.

    None of them may be an input (the source file, the weights); the model and the sidecar need ``force`` to replace
    an existing file. The external-data file is part of the model and is replaced with it.
    """
    src_path, _ = split_source(cfg.source)
    inputs = [src_path, cfg.weights]
    out = check_output_path(cfg.output, inputs, force=cfg.force)
    if out.suffix != ".onnx":
        raise InvalidInputError(format_message(f"Output '{cfg.output}'", f"suffix '{out.suffix}'", "'.onnx'"))
    sidecar = check_output_path(sidecar_path(out), inputs, force=cfg.force)
    check_output_path(data_file(out), inputs, force=True)
    return out, sidecar


def export_onnx(cfg: ExportConfig) -> ExportResult:
    """Export a torch model to a checked, parity-verified ONNX model.

    Args:
        cfg: The export settings.

    Returns:
        Paths written, exporter used and parity numbers.

    Raises:
        InvalidInputError: Bad specs, output path equal to an input or existing without force.
        ModelLoadError: The model or weights cannot be loaded.
        ExportError: Every exporter tried failed.
        AccuracyMismatchError: Parity torch vs ONNX Runtime above tolerance.
    """
    _check_config(cfg)
    out, sidecar = _check_outputs(cfg)
    # model, data and sidecar: claimed before the work, published together (the data file goes with the model)
    with claim_outputs([out, data_file(out), sidecar], force=cfg.force, replaceable=[data_file(out)]) as claim:
        return _export(cfg, claim, out, sidecar)


def _export(cfg: ExportConfig, claim: Any, out: Path, sidecar: Path) -> ExportResult:
    """export_onnx's work, with its outputs claimed (written under ``claim.stage``, then published)."""
    import onnx
    import torch

    loaded = load_model(cfg.source, cfg.weights, trust_weights=cfg.trust_weights)
    # a causal LM takes and returns its KV cache (mpinfer.export.kv), unless --no-past or --input says otherwise
    loaded = with_kv_cache(loaded) if cfg.past and not cfg.inputs else loaded
    specs = resolve_specs(loaded, cfg.inputs, cfg.dynamic)
    check_forward_inputs(loaded, [s.name for s in specs])
    if loaded.kind == "huggingface" and loaded.kv is None:  # the KV wrapper takes its own fixed inputs
        bind_hf_inputs(loaded, [s.name for s in specs])

    args = _to_torch(random_batch(specs, np.random.default_rng(0)), specs)
    with torch.no_grad():
        try:
            ref = flatten_outputs(loaded.module.module()(*args) if hasattr(loaded.module, "module")
                                  and isinstance(loaded.module, torch.export.ExportedProgram)
                                  else loaded.module(*args))
        except Exception as err:
            raise ExportError(format_message(f"Model '{cfg.source}' on inputs {[str(s) for s in specs]}",
                                             f"{type(err).__name__}: {err}", "a forward pass that runs",
                                             "check --input shapes and dtypes")) from err
    out_names = list(cfg.output_names or loaded.output_names) or (
        ["output"] if len(ref) == 1 else [f"output_{i}" for i in range(len(ref))])
    if len(out_names) != len(ref):
        raise InvalidInputError(format_message("Output names", f"{len(out_names)} names", f"{len(ref)} outputs"))
    tmp = claim.scratch()  # the exporters' scratch files: in the claim's staging folder, removed with it
    # the torch side of parity first: the torch model is freed before the ONNX model is read and run
    cases = parity_reference(loaded.module, specs, runs=cfg.parity_runs)
    path, exporter, why = _run_exporters(cfg, loaded, args, specs, out_names, tmp)
    description, out_axes = loaded.description, loaded.output_axes
    del loaded, args, ref
    gc.collect()
    model = _post_process(path, specs, description, exporter, out_axes)
    opset = default_opset(model)
    staged = _write_model(model, claim.stage(out), data_file(out).name, path.parent)
    del model  # the proto held the weights until written: dropped before ONNX Runtime maps them
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        onnx.checker.check_model(str(staged), full_check=True)
    except Exception as err:  # checker raises ValidationError / InferenceError
        raise ExportError(f"The {exporter} exporter produced a model onnx.checker rejects: {err}. "
                          "Hint: try the other --exporter or another --opset.") from err
    parity = compare_parity(cases, staged, out_names, atol=cfg.atol, rtol=cfg.rtol)
    if not parity.passed:
        raise AccuracyMismatchError(
            f"Parity torch vs ONNX Runtime failed for '{cfg.source}' ({exporter} exporter): "
            f"{parity.worst_summary()} exceeds atol={cfg.atol}, rtol={cfg.rtol}. "
            "Hint: try the other --exporter; nothing was written.")
    info = {
        "schema_version": 1, "mpinfer_version": __version__, "source": description,
        "exporter": exporter, "fallback_reason": why, "opset": opset,
        "ir_version": int(onnx.load(str(claim.stage(out)), load_external_data=False).ir_version),
        "torch_version": torch.__version__, "onnx_version": onnx.__version__,
        "inputs": [str(s) for s in specs], "outputs": out_names,
        "tolerance": {"atol": cfg.atol, "rtol": cfg.rtol}, "parity": parity.to_dict(),
    }
    write_json_atomic(claim.stage(sidecar), info)
    claim.publish()  # model, data and sidecar: both or neither
    logger.info("exported %s with %s (opset %d); parity max abs %.3g", out, exporter, opset, parity.max_abs)
    return ExportResult(out, sidecar, exporter, opset, parity, why, specs)
