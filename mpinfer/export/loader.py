"""Load a torch model from what a user has on disk.

Sources:

* ``file.py:factory`` (factory defaults to ``build``), with optional ``--weights``: a state_dict or a
  trainer checkpoint (``{"model": state_dict, ...}``), loaded with ``weights_only=True``;
* a TorchScript file (``torch.jit.save``), recognised by its archive layout;
* a ``torch.export`` program (``.pt2``);
* a local Hugging Face model folder (``config.json`` inside; extra ``hf``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpinfer.errors import InvalidInputError, ModelLoadError, format_message

logger = logging.getLogger(__name__)

_SOURCES = "file.py:factory, a TorchScript file, a torch.export .pt2 file or a Hugging Face folder"


@dataclass
class LoadedModel:
    """A torch model ready to export.

    Attributes:
        module: An ``nn.Module``, ``ScriptModule`` or ``ExportedProgram``.
        kind: ``factory``, ``torchscript``, ``exported-program`` or ``huggingface``.
        example_inputs: Example tensors (from the factory file's ``example_inputs()``), if any.
        input_specs: Spec strings the source declares (``INPUT_SPECS``), if any.
        input_names: Input names the source declares, if any.
        output_names: Output names the source declares (``OUTPUT_NAMES``), if any.
        description: Where it came from, for the sidecar.
        kv: The KV-cache layout (:class:`mpinfer.data.decode.KvLayout`) when the module is a causal LM wrapped
            to take and return its cache as flat tensors; None otherwise.
        output_axes: Dynamic output axes by output name (``{"logits": {0: "batch"}}``), when the source knows them.
    """

    module: Any
    kind: str
    example_inputs: tuple[Any, ...] | None = None
    input_specs: list[str] = field(default_factory=list)
    input_names: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    description: str = ""
    kv: Any = None
    output_axes: dict[str, dict[int, str]] = field(default_factory=dict)


def split_source(source: str) -> tuple[Path, str | None]:
    """Split ``path[:factory]`` (a Windows drive letter is not a factory)."""
    head, sep, tail = source.rpartition(":")
    if sep and head and tail and "/" not in tail and "\\" not in tail and len(head) > 1:
        return Path(head), tail
    return Path(source), None


def import_user_file(path: Path) -> Any:
    """Import a user's model file as a module registered under a stable private name.

    Raises:
        ModelLoadError: Missing file, or any error raised while importing it.
    """
    if not path.is_file():
        raise ModelLoadError(format_message(f"Model file '{path}'", "no such file", "an existing .py file"))
    # hashlib, not hash(): str hashes change per process, and the name lands in the exported ONNX metadata
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
    name = f"mpinfer_user_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(format_message(f"Model file '{path}'", "a file Python cannot import",
                                            "a .py file defining a factory function"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # torch.compile/export and pickling look modules up by name
    root = str(path.resolve().parent)
    sys.path.insert(0, root)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # user code: any failure is the user's to fix
        sys.modules.pop(name, None)
        raise ModelLoadError(f"Model file '{path}' failed to import: {type(err).__name__}: {err}") from err
    finally:
        if sys.path and sys.path[0] == root:
            sys.path.pop(0)
    return module


def import_factory(path: Path, factory: str) -> tuple[Any, Any]:
    """Import ``path`` and return ``(module, factory callable)``.

    Raises:
        ModelLoadError: Missing file, import error, or no callable of that name (the message lists the
            callables the file defines).
    """
    mod = import_user_file(path)
    fn = getattr(mod, factory, None)
    if not callable(fn):
        found = sorted(n for n in dir(mod) if callable(getattr(mod, n)) and not n.startswith("_")
                       and getattr(getattr(mod, n), "__module__", None) == mod.__name__)
        raise ModelLoadError(format_message(f"Model file '{path}'", f"no callable factory '{factory}'",
                                            "a function returning an nn.Module",
                                            f"callables defined there: {', '.join(found) or 'none'}"))
    return mod, fn


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[0].rstrip(".") if lines else type(err).__name__


def _unpickler_line(err: BaseException) -> str:
    """The line of torch's weights_only refusal that names the object it refused (its first line says nothing)."""
    for line in str(err).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip().split(". ", 1)[0]
    return _first_line(err)


def _damage(weights: Path) -> str | None:
    """What is wrong with a weights file that cannot be a whole torch.save file (empty, a cut-short zip), or None."""
    size = weights.stat().st_size
    if size == 0:
        return "an empty file"
    with weights.open("rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04" and not zipfile.is_zipfile(weights):  # torch.save's zip format without its end
        return f"a truncated file ({size} bytes: the start of a torch.save zip archive, without its end)"
    return None


def load_state_dict(weights: Path, *, trusted: bool = False) -> dict[str, Any]:
    """Load a state_dict, or the ``model`` entry of a trainer checkpoint, with ``weights_only=True``.

    Raises:
        ModelLoadError: Unreadable file, or no state_dict inside.
    """
    import torch

    if not weights.is_file():
        raise ModelLoadError(format_message(f"Weights file '{weights}'", "no such file", "an existing .pt file"))
    damage = _damage(weights)
    if damage is not None:  # torch.load would say only "[Errno 22] Invalid argument", trusted or not
        raise ModelLoadError(format_message(
            f"Weights file '{weights}'", damage, "a complete state_dict or checkpoint file",
            "it was cut short (an interrupted copy, download or save): copy or save it again; --trust-weights "
            "cannot help"))
    try:
        obj = torch.load(weights, map_location="cpu", weights_only=not trusted)
    except Exception as err:  # torch raises UnpicklingError, RuntimeError, EOFError, OSError ...
        refused_global = not trusted and "Weights only load failed" in str(err)
        hint = ("it holds Python objects besides tensors; re-save it as a plain state_dict, or pass "
                "--trust-weights if you trust its author" if refused_global else
                "it may be damaged: copy or save it again")
        raise ModelLoadError(format_message(f"Weights file '{weights}'",
                                            f"a file torch.load(weights_only={not trusted}) refused "
                                            f"({_unpickler_line(err) if refused_global else _first_line(err)})",
                                            "a state_dict or a checkpoint with a 'model' entry", hint)) from err
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise ModelLoadError(format_message(f"Weights file '{weights}'", f"a {type(obj).__name__}",
                                            "a state_dict (str -> tensor) or a checkpoint with a 'model' entry"))
    # DDP checkpoints prefix every key with 'module.'
    if obj and all(k.startswith("module.") for k in obj):
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return obj


def apply_weights(module: Any, state: dict[str, Any], weights: Path) -> None:
    """Load ``state`` into ``module`` strictly, with a message listing what does not match.

    Raises:
        ModelLoadError: Missing/unexpected keys or shape mismatches.
    """
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k}: {tuple(state[k].shape)} vs model {tuple(own[k].shape)}" for k in own
              if k in state and hasattr(state[k], "shape") and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} keys (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (e.g. {', '.join(unexpected[:3])})")
        if shapes:
            parts.append(f"{len(shapes)} shape mismatches (e.g. {shapes[0]})")
        raise ModelLoadError(format_message(f"Weights '{weights}' do not match the model", "; ".join(parts),
                                            "the state_dict of this architecture",
                                            "check the factory arguments (width, classes) used in training"))
    module.load_state_dict(state, strict=True)


def _is_torchscript(path: Path) -> bool:
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    return any(n.endswith("constants.pkl") for n in names) and any("/code/" in n for n in names)


def _is_exported_program(path: Path) -> bool:
    if path.suffix == ".pt2":
        return True
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return any("serialized_exported_program" in n or n.endswith("models/model.json") for n in z.namelist())


def load_model(source: str, weights: Path | None = None, *, trust_weights: bool = False) -> LoadedModel:
    """Load a torch model from ``source`` (see module docstring).

    Args:
        source: ``file.py[:factory]``, a TorchScript file, a ``.pt2`` file or a Hugging Face folder.
        weights: Optional state_dict/checkpoint for a factory model.
        trust_weights: Load weights with ``weights_only=False`` (only for files you trust).

    Returns:
        The loaded model, in eval mode.

    Raises:
        ModelLoadError: If anything about the source or weights is wrong.
    """
    import torch

    path, factory = split_source(source)
    if not path.exists():
        raise ModelLoadError(format_message(f"Model '{source}'", "no such file or folder", _SOURCES))
    if path.is_dir():
        return _load_hf(path, weights)
    if path.suffix == ".py":
        return _load_factory(path, factory or "build", weights, trust_weights)
    if weights is not None:
        raise InvalidInputError(format_message("--weights", f"'{weights}' with a serialized model '{source}'",
                                               "weights only for file.py:factory sources",
                                               "a TorchScript/.pt2 file already holds its weights"))
    try:
        if _is_torchscript(path):
            mod = torch.jit.load(str(path), map_location="cpu").eval()
            return LoadedModel(mod, "torchscript", description=f"TorchScript {path}")
        if _is_exported_program(path):
            ep = torch.export.load(str(path))
            args = tuple(getattr(ep, "example_inputs", None) or ((),))[0]
            return LoadedModel(ep, "exported-program", example_inputs=tuple(args) if args else None,
                               description=f"torch.export program {path}")
    except Exception as err:  # torch raises many types for corrupt archives
        raise ModelLoadError(f"Model '{source}' could not be loaded: {type(err).__name__}: {err}") from err
    if path.suffix.lower() == ".onnx":
        raise InvalidInputError(format_message(
            f"Model '{source}'", "an ONNX model (already exported)", "a torch model: " + _SOURCES,
            f"export is for torch models; convert this one to mixed precision with `mpinfer convert {source} -o "
            f"{path.with_suffix('.fp16.onnx')}`"))
    raise ModelLoadError(format_message(f"Model '{source}'", f"a '{path.suffix or 'suffix-less'}' file of unknown kind",
                                        _SOURCES, "plain state_dict files go in --weights next to file.py:factory"))


def _load_factory(path: Path, factory: str, weights: Path | None, trust: bool) -> LoadedModel:
    import torch

    mod, fn = import_factory(path, factory)
    try:
        model = fn()
    except Exception as err:
        raise ModelLoadError(f"Factory '{path}:{factory}' raised {type(err).__name__}: {err}") from err
    if not isinstance(model, torch.nn.Module):
        raise ModelLoadError(format_message(f"Factory '{path}:{factory}'", f"a {type(model).__name__}",
                                            "a torch.nn.Module"))
    if weights is not None:
        apply_weights(model, load_state_dict(weights, trusted=trust), weights)
    model.eval()
    examples = None
    if callable(getattr(mod, "example_inputs", None)):
        ex = mod.example_inputs()
        examples = tuple(ex) if isinstance(ex, (tuple, list)) else (ex,)
    return LoadedModel(
        model, "factory", example_inputs=examples,
        input_specs=list(getattr(mod, "INPUT_SPECS", []) or []),
        input_names=list(getattr(mod, "INPUT_NAMES", []) or []),
        output_names=list(getattr(mod, "OUTPUT_NAMES", []) or []),
        description=f"{path}:{factory}" + (f" + weights {weights}" if weights else ""),
    )


def _load_hf(path: Path, weights: Path | None) -> LoadedModel:
    """A Hugging Face folder as the class its config names (``architectures``), so a task head stays on.

    ``AutoModel`` would load the bare encoder of a ``BertForSequenceClassification`` or ``LlamaForCausalLM``
    checkpoint and drop its head with only a log line; the config's class keeps it. Inputs default to the
    model's ``main_input_name`` (token ids and mask, pixels, audio features or samples); outputs are the
    tensors of its output object (``last_hidden_state`` alone for a bare model, as feature extraction uses).
    :func:`mpinfer.export.kv.with_kv_cache` wraps a causal LM to take and return its KV cache instead.
    """
    if not (path / "config.json").is_file():
        raise ModelLoadError(format_message(f"Model folder '{path}'", "a folder without config.json",
                                            "a local Hugging Face model folder (save_pretrained)"))
    if weights is not None:
        raise InvalidInputError(format_message("--weights", f"'{weights}' with a Hugging Face folder",
                                               "no --weights: the folder holds its weights"))
    try:
        import transformers
    except ImportError as err:
        raise ModelLoadError("Loading a Hugging Face folder needs transformers. "
                             "Hint: pip install 'mpinfer[hf]'") from err
    if not logger.isEnabledFor(logging.WARNING):  # -q: transformers' own progress bars off too
        transformers.utils.logging.disable_progress_bar()
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
        archs = list(getattr(config, "architectures", None) or [])
        cls = getattr(transformers, archs[0], None) if archs else None
        if cls is None or not hasattr(cls, "from_pretrained"):
            logger.warning("config.json of '%s' names no architecture this transformers has (%s); loading "
                           "AutoModel, the bare model without a task head", path, archs or "none")
            cls = transformers.AutoModel
        model = cls.from_pretrained(str(path), local_files_only=True)
    except Exception as err:
        raise ModelLoadError(f"Hugging Face model '{path}' could not be loaded: {err}") from err
    model.eval()
    specs = _hf_input_specs(model)
    names = [s.split(":", 1)[0] for s in specs]
    outputs: list[str] = []  # filled by the wrapper's forward (see _keyword_call_class)
    return LoadedModel(_KeywordCall(model, names, outputs), "huggingface",
                       input_specs=specs, input_names=names, output_names=outputs,
                       description=f"Hugging Face {path} ({type(model).__name__})")


def _hf_input_specs(model: Any) -> list[str]:
    """Default input specs from the model's ``main_input_name`` and config ([] when unknown: pass --input)."""
    config = model.config
    main = getattr(model, "main_input_name", "input_ids")
    accepted = hf_forward_inputs(model)
    if main == "input_ids":
        vocab = int(getattr(config, "vocab_size", 1000) or 1000)
        specs = [f"input_ids:batchxseq=16:int64:0..{vocab}"]
        if "attention_mask" in accepted:
            specs.append("attention_mask:batchxseq=16:int64:1..2")
        return specs
    if main == "pixel_values":
        size = getattr(config, "image_size", 224)
        h, w = (size, size) if isinstance(size, int) else tuple(size)[:2]
        return [f"pixel_values:batchx{int(getattr(config, 'num_channels', 3))}x{int(h)}x{int(w)}:float32"]
    if main == "input_features" and getattr(config, "num_mel_bins", None) and getattr(config, "max_source_positions",
                                                                                       None):
        frames = 2 * int(config.max_source_positions)  # Whisper's encoder takes exactly twice its positions
        return [f"input_features:batchx{int(config.num_mel_bins)}x{frames}:float32"]
    if main == "input_values":
        return ["input_values:batchxsamples=16000:float32"]
    return []


def hf_forward_inputs(model: Any) -> list[str]:
    """The keyword inputs a Hugging Face model's ``forward`` takes."""
    import inspect

    return [n for n, p in inspect.signature(model.forward).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


# Inputs the Hugging Face wrapper passes by name (fixed positional parameters: torch.export treats *args as a
# single tuple input).
HF_MAX_INPUTS = 8


def _keyword_call_class() -> Any:
    import torch

    class KeywordCall(torch.nn.Module):
        """Calls a Hugging Face model with keyword inputs and returns the tensors of its output object.

        Positional order differs between architectures (GPT-2's second argument is the KV cache), and
        exporters pass positional tensors, so the wrapper maps them to names (``names``, set to the export's
        input specs) and turns the cache off. The output names go into ``outputs`` at every call.
        """

        def __init__(self, model: Any, names: list[str], outputs: list[str]) -> None:
            super().__init__()
            self.model = model
            self.names = names
            self.outputs = outputs

        def forward(self, x0: Any, x1: Any = None, x2: Any = None, x3: Any = None, x4: Any = None,
                    x5: Any = None, x6: Any = None, x7: Any = None) -> Any:
            args = (x0, x1, x2, x3, x4, x5, x6, x7)
            kwargs = {n: t for n, t in zip(self.names, args) if t is not None}
            out = self.model(**kwargs, use_cache=False, return_dict=True) if _accepts_cache(self.model) \
                else self.model(**kwargs, return_dict=True)
            keys = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
            if "last_hidden_state" in keys:  # a bare model: its features (pooler and hidden states are extras)
                keys = ["last_hidden_state"]
            if not keys:
                raise ValueError(f"{type(self.model).__name__} returned no tensors (output keys: {list(out)})")
            self.outputs[:] = keys
            return tuple(out[k] for k in keys) if len(keys) > 1 else out[keys[0]]

    return KeywordCall


def check_forward_inputs(loaded: LoadedModel, names: list[str]) -> None:
    """The export's input names are the factory model's ``forward`` arguments, in order (they are passed by position).

    A forward taking ``*args`` accepts any name, and so does a torch module used as it is (``nn.Sequential``);
    other sources (TorchScript, .pt2, Hugging Face) are checked elsewhere or name their inputs themselves.

    Raises:
        InvalidInputError: A name that is not the forward argument at its position, naming the arguments.
    """
    import inspect

    import torch

    if loaded.kind != "factory" or isinstance(loaded.module, torch.jit.ScriptModule):
        return  # a scripted factory model names its inputs in its own graph
    if str(getattr(type(loaded.module).forward, "__module__", "")).startswith("torch."):
        return  # a torch module as it is (nn.Sequential's ``input``): its argument name means nothing to the user
    try:
        params = list(inspect.signature(loaded.module.forward).parameters.values())
    except (TypeError, ValueError):  # a forward inspect cannot read: nothing to check against
        return
    positional = []
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            return
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional.append(p.name)
    wrong = [(i, n) for i, n in enumerate(names) if i >= len(positional) or positional[i] != n]
    if wrong:
        i, name = wrong[0]
        expected = (f"'{positional[i]}' (forward's argument {i + 1})" if i < len(positional)
                    else f"at most {len(positional)} inputs")
        raise InvalidInputError(format_message(
            f"Input '{name}' of {loaded.description}", f"input {i + 1} named '{name}'", expected,
            f"the ONNX inputs take forward's argument names, in order: {', '.join(positional) or 'none'}; "
            "write --input " + " --input ".join(f"{a}:..." for a in positional[: max(len(names), 1)])))


def bind_hf_inputs(loaded: LoadedModel, names: list[str]) -> None:
    """Point a Hugging Face wrapper at the export's input names (from --input or the defaults).

    Raises:
        InvalidInputError: More inputs than the wrapper passes, or a name the model's forward does not take.
    """
    wrapper = loaded.module
    accepted = hf_forward_inputs(wrapper.model)
    unknown = [n for n in names if n not in accepted]
    if unknown or len(names) > HF_MAX_INPUTS:
        raise InvalidInputError(format_message(
            f"--input {', '.join(unknown) or f'({len(names)} inputs)'}",
            "names the model's forward does not take" if unknown else f"more than {HF_MAX_INPUTS} inputs",
            f"at most {HF_MAX_INPUTS} of {type(wrapper.model).__name__}.forward's inputs: "
            f"{', '.join(a for a in accepted if a not in _HF_NOT_INPUTS)}"))
    wrapper.names = list(names)


# forward parameters that are flags or caches, not tensors to feed
_HF_NOT_INPUTS = {"use_cache", "return_dict", "output_attentions", "output_hidden_states", "past_key_values",
                  "labels", "kwargs", "cache_position", "logits_to_keep", "return_loss"}


def _accepts_cache(model: Any) -> bool:
    return "use_cache" in hf_forward_inputs(model)


def _KeywordCall(model: Any, names: list[str], outputs: list[str]) -> Any:  # noqa: N802 - builds the nn.Module lazily
    return _keyword_call_class()(model, names, outputs).eval()
