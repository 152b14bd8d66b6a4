"""Decoders with a KV cache: their input layout, greedy decoding, and calibration feeds from real decoding.

A model exported with its KV cache (``mpinfer export`` of a causal LM, like Optimum's
``text-generation-with-past``) takes ``input_ids``, ``attention_mask`` (past + new tokens), ``position_ids`` and
``past_key_values.{i}.key/value`` ``[batch, kv_heads, past, head_dim]``, and returns ``logits`` and
``present.{i}.key/value`` ``[batch, kv_heads, past + new, head_dim]``. The prefill feeds an empty past (length 0);
each decode step feeds one token and the previous step's presents as its past.

Calibration of such a model from prompts (``prompts:FILE[:steps=N]``, or an .npz holding only ``input_ids``
and optionally ``attention_mask``) runs the FP32 model's prefill and ``N`` greedy decode steps itself and yields
every step's complete feeds, so range statistics and the budget see real past-KV tensors at real lengths.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.data.source import FeedSource, read_npz
from mpinfer.errors import InvalidInputError, format_message
from mpinfer.modelio import ort_session
from mpinfer.specs import TensorSpec

logger = logging.getLogger(__name__)

PAST_KEY = "past_key_values.{layer}.key"
PAST_VALUE = "past_key_values.{layer}.value"
PRESENT_KEY = "present.{layer}.key"
PRESENT_VALUE = "present.{layer}.value"
# Greedy decode steps a prompts calibration source runs after each prefill when the spec names none: enough for
# the past to grow past the prompt and for decode-shaped (one token) batches to weigh in the statistics.
DEFAULT_CALIBRATION_STEPS = 4
PROMPTS_PREFIX = "prompts:"
# A prompts source decodes once and keeps the feeds when they come to at most this many bytes: calibration, the
# budget search and the verification read the same batches again without opening the FP32 model again, and the
# decoding session is closed before the first batch is used. Past it, each pass decodes again as it goes.
DECODE_CACHE_BYTES = 512 * 2**20
_PAST_RE = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")

# run(feeds) -> outputs by name
RunFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


@dataclass(frozen=True)
class KvLayout:
    """The KV-cache inputs of a decoder.

    Attributes:
        num_layers: Layers with a key/value pair.
        kv_heads: Key/value heads (grouped-query attention keeps fewer than the query heads).
        head_dim: Size of one head.
        dtype: Dtype of the cache tensors.
        has_position_ids: Whether the model takes ``position_ids``.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: np.dtype
    has_position_ids: bool = True

    @property
    def past_names(self) -> list[str]:
        """``past_key_values.{i}.key/value`` in layer order."""
        return [n.format(layer=i) for i in range(self.num_layers) for n in (PAST_KEY, PAST_VALUE)]

    @property
    def present_names(self) -> list[str]:
        """``present.{i}.key/value`` in layer order."""
        return [n.format(layer=i) for i in range(self.num_layers) for n in (PRESENT_KEY, PRESENT_VALUE)]

    @property
    def input_names(self) -> list[str]:
        """Every input the model takes, in export order."""
        head = ["input_ids", "attention_mask"] + (["position_ids"] if self.has_position_ids else [])
        return head + self.past_names

    @property
    def output_names(self) -> list[str]:
        """``logits`` and the presents."""
        return ["logits", *self.present_names]


def kv_layout(specs: Sequence[TensorSpec]) -> KvLayout | None:
    """The KV layout of a model from its input specs, or None when it takes no ``past_key_values.*``."""
    by_name = {s.name: s for s in specs}
    layers = sorted({int(m.group(1)) for s in specs for m in [_PAST_RE.match(s.name)] if m})
    if not layers or "input_ids" not in by_name or "attention_mask" not in by_name:
        return None
    if layers != list(range(len(layers))):
        return None
    first = by_name.get(PAST_KEY.format(layer=0))
    if first is None or len(first.shape) != 4 or not all(isinstance(d, int) for d in first.shape[1::2]):
        return None
    return KvLayout(len(layers), int(first.shape[1]), int(first.shape[3]), np.dtype(first.dtype),
                    "position_ids" in by_name)


def kv_dims(specs: Sequence[TensorSpec], dims: Mapping[str, int] | None) -> Mapping[str, int] | None:
    """Random-data dim sizes for a KV-cache model: ``total`` follows ``past + seq`` unless given itself.

    The export's example sizes are consistent already; a ``--dim seq=32`` alone would otherwise leave the mask
    (``total``) at its example size, a feed the model rejects.
    """
    if not dims or "total" in dims or kv_layout(specs) is None:
        return dims
    sizes = {k: v for s in specs for k, v in s.dim_sizes.items()} | dict(dims)
    if "seq" not in sizes or "past" not in sizes:
        return dims
    return {**dims, "total": int(sizes["seq"]) + int(sizes["past"])}


def positions(attention_mask: np.ndarray, start: int = 0) -> np.ndarray:
    """Position ids of the last ``attention_mask.shape[1] - start`` tokens: count of real tokens before each.

    Padding (left or right) gets position 0, like Hugging Face's ``generate``.
    """
    pos = np.cumsum(attention_mask, axis=1) - 1
    pos = np.where(attention_mask == 0, 0, pos)
    return pos[:, start:].astype(np.int64)


def prefill_feeds(layout: KvLayout, input_ids: np.ndarray, attention_mask: np.ndarray | None = None
                  ) -> dict[str, np.ndarray]:
    """Feeds of a prefill: the prompts with an empty (length 0) past."""
    ids = np.asarray(input_ids, dtype=np.int64)
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask}
    if layout.has_position_ids:
        feeds["position_ids"] = positions(mask)
    empty = np.zeros((ids.shape[0], layout.kv_heads, 0, layout.head_dim), dtype=layout.dtype)
    feeds.update({name: empty for name in layout.past_names})
    return feeds


def next_feeds(layout: KvLayout, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
               tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Feeds of the decode step after ``feeds``: one new token per row, the presents as the past."""
    batch = tokens.shape[0]
    mask = np.concatenate([feeds["attention_mask"], np.ones((batch, 1), dtype=np.int64)], axis=1)
    out = {"input_ids": tokens.reshape(batch, 1).astype(np.int64), "attention_mask": mask}
    if layout.has_position_ids:
        out["position_ids"] = positions(mask, mask.shape[1] - 1)
    for past, present in zip(layout.past_names, layout.present_names):
        out[past] = np.asarray(outputs[present])
    return out


@dataclass
class DecodeStep:
    """One model call of a greedy decode: step 0 is the prefill."""

    step: int
    feeds: dict[str, np.ndarray]
    logits: np.ndarray  # [batch, vocab]: the last position's logits
    tokens: np.ndarray  # [batch]: the greedy choice


def greedy_decode(run: RunFn, layout: KvLayout, input_ids: np.ndarray, attention_mask: np.ndarray | None,
                  steps: int, *, forced: np.ndarray | None = None) -> Iterator[DecodeStep]:
    """Prefill, then ``steps`` greedy decode steps; yields each call's feeds, last logits and next tokens.

    Args:
        run: Runs the model on feeds, returning its outputs by name.
        layout: The model's KV layout.
        input_ids: Prompts ``[batch, seq]``.
        attention_mask: Their mask (1 = real token; default all ones).
        steps: Decode steps after the prefill (``steps + 1`` tokens are chosen).
        forced: ``[batch, >= steps]`` tokens to feed instead of the greedy choices (teacher forcing), or None.
    """
    feeds = prefill_feeds(layout, input_ids, attention_mask)
    for step in range(steps + 1):
        outputs = run(feeds)
        logits = np.asarray(outputs["logits"])[:, -1, :]
        tokens = np.argmax(logits, axis=-1).astype(np.int64)
        yield DecodeStep(step, feeds, logits, tokens)
        if step == steps:
            return
        feed_tokens = tokens if forced is None else np.asarray(forced[:, step], dtype=np.int64)
        feeds = next_feeds(layout, feeds, outputs, feed_tokens)


def ort_run_fn(session: Any, output_names: Sequence[str]) -> RunFn:
    """A :data:`RunFn` over an ONNX Runtime session."""
    names = list(output_names)

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, dict(feeds))))

    return run


@dataclass(frozen=True)
class Prompts:
    """Prompts to decode from: token ids and their mask."""

    input_ids: np.ndarray
    attention_mask: np.ndarray

    @property
    def count(self) -> int:
        """Number of prompts."""
        return int(self.input_ids.shape[0])


def read_prompts(path: Path, vocab_size: int | None = None) -> Prompts:
    """Prompts from an .npz with ``input_ids`` ``[N, T]`` and an optional ``attention_mask``.

    Raises:
        InvalidInputError: Missing file or array, wrong rank or dtype, token ids outside the vocabulary.
    """
    if not path.is_file():
        raise InvalidInputError(format_message(f"Prompts '{path}'", "no such file", "an .npz with input_ids [N, T]"))
    arrays = read_npz(path)
    ids = arrays.get("input_ids")
    if ids is None or ids.ndim != 2 or ids.dtype.kind not in "iu" or ids.size == 0:
        got = "no input_ids" if ids is None else f"input_ids of shape {list(ids.shape)} and dtype {ids.dtype}"
        raise InvalidInputError(format_message(f"Prompts '{path}'", got, "input_ids: integers of shape [N, T]",
                                               "np.savez(path, input_ids=ids) with one prompt per row"))
    mask = arrays.get("attention_mask")
    return _checked_prompts(f"Prompts '{path}'", ids, np.ones_like(ids) if mask is None else mask, vocab_size)


def _checked_prompts(what: str, ids: np.ndarray, mask: np.ndarray, vocab_size: int | None) -> Prompts:
    if mask.shape != ids.shape:
        raise InvalidInputError(format_message(f"{what}: attention_mask", f"shape {list(mask.shape)}",
                                               f"the shape of input_ids, {list(ids.shape)}"))
    if not np.all(mask.sum(axis=1) > 0):
        raise InvalidInputError(format_message(f"{what}: attention_mask", "a row of zeros",
                                               "at least one real token per prompt"))
    if vocab_size is not None and (ids.min() < 0 or ids.max() >= vocab_size):
        raise InvalidInputError(format_message(f"{what}: input_ids", f"values {int(ids.min())}..{int(ids.max())}",
                                               f"token ids in 0..{vocab_size - 1} (the model's vocabulary)"))
    return Prompts(ids.astype(np.int64), mask.astype(np.int64))


@dataclass(frozen=True)
class PromptsSpec:
    """Where prompts come from: ``prompts:FILE[:steps=N][:tokenizer=DIR]``, or a bare .npz path."""

    path: Path
    steps: int = DEFAULT_CALIBRATION_STEPS
    tokenizer: Path | None = None


_OPTION_RE = re.compile(r":(steps|tokenizer)=([^:]*)$")
_SPEC_HINT = "prompts:FILE[:steps=N][:tokenizer=DIR], e.g. prompts:prompts.npz:steps=8"


def parse_prompts_spec(source: str | Path) -> PromptsSpec:
    """Parse a prompts spec (a bare path is an .npz of prompts with the default steps).

    Raises:
        InvalidInputError: A malformed spec.
    """
    text = str(source)
    if not text.startswith(PROMPTS_PREFIX):
        return PromptsSpec(Path(text))
    body, options = text[len(PROMPTS_PREFIX):], {}
    while (m := _OPTION_RE.search(body)) is not None and m.group(1) not in options:
        options[m.group(1)] = m.group(2)
        body = body[:m.start()]
    steps = options.get("steps", str(DEFAULT_CALIBRATION_STEPS))
    if not body or not steps.isdigit() or options.get("tokenizer") == "":
        raise InvalidInputError(format_message("Data source", repr(text), "a prompts file and steps N >= 0",
                                               _SPEC_HINT))
    tok = options.get("tokenizer")
    return PromptsSpec(Path(body), int(steps), Path(tok) if tok else None)


def tokenize_prompts(path: Path, tokenizer: Path | None, vocab_size: int | None = None) -> Prompts:
    """Prompts from a text file, one per line, tokenized by a local Hugging Face tokenizer (left padding).

    Raises:
        InvalidInputError: No tokenizer given or loadable, an empty file, or ids outside the vocabulary.
    """
    if tokenizer is None:
        raise InvalidInputError(format_message(f"Prompts '{path}'", "a text file without a tokenizer",
                                               "prompts:FILE.txt:tokenizer=DIR (a folder with the tokenizer files)",
                                               "or tokenize the prompts into an .npz of input_ids"))
    if not path.is_file():
        raise InvalidInputError(format_message(f"Prompts '{path}'", "no such file", "a text file, one prompt a line"))
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines:
        raise InvalidInputError(format_message(f"Prompts '{path}'", "no non-empty line", "one prompt per line"))
    try:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    except Exception as err:  # ImportError, OSError, ValueError: whatever stops the tokenizer from loading
        raise InvalidInputError(format_message(f"Tokenizer '{tokenizer}'", f"{type(err).__name__}: {err}",
                                               "a local Hugging Face tokenizer folder (save_pretrained)")) from err
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    enc = tok(lines, padding=True, return_tensors="np")
    ids, mask = np.asarray(enc["input_ids"], np.int64), np.asarray(enc["attention_mask"], np.int64)
    return _checked_prompts(f"Prompts '{path}' (tokenized)", ids, mask, vocab_size)


def load_prompts(source: str | Path, vocab_size: int | None = None) -> tuple[Prompts, PromptsSpec]:
    """Prompts of a spec: an .npz of token ids, or a text file with ``tokenizer=DIR``."""
    spec = parse_prompts_spec(source)
    if spec.path.suffix == ".npz":
        return read_prompts(spec.path, vocab_size), spec
    return tokenize_prompts(spec.path, spec.tokenizer, vocab_size), spec


def wants_decode(source: str | Path | None, specs: Sequence[TensorSpec]) -> bool:
    """True when the model should decode ``source`` itself.

    That is a ``prompts:`` spec, or an .npz of prompts only (``input_ids``, ``attention_mask``) for a model with a
    KV cache.
    """
    if source is None:
        return False
    text = str(source)
    if text.startswith(PROMPTS_PREFIX):
        return True
    if kv_layout(specs) is None or not text.endswith(".npz") or not Path(text).is_file():
        return False
    with np.load(text, allow_pickle=False) as z:
        names = set(z.files)
    return "input_ids" in names and names <= {"input_ids", "attention_mask"}


@dataclass
class DecodeFeedSource(FeedSource):
    """A FeedSource from greedy decoding; ``batch_steps[i]`` is batch i's step (0: the prefill)."""

    batch_steps: tuple[int, ...] = ()


def decode_source(source: str | Path, specs: Sequence[TensorSpec], model: Any, *, batch_size: int,
                  num_batches: int | None = None) -> DecodeFeedSource:
    """A feed source that decodes prompts with the FP32 ``model`` and yields every call's feeds.

    Batches come per group of ``batch_size`` prompts: the prefill, then one batch per decode step
    (``batch_steps`` holds each batch's step, 0 for a prefill).

    Args:
        source: ``prompts:FILE[:steps=N]`` or a prompts-only .npz path.
        specs: The model's inputs (must include a KV cache).
        model: The FP32 model (ModelProto or path) that decodes, or a :data:`RunFn` running it (an open
            session's: no second one is opened).
        batch_size: Prompts per batch.
        num_batches: Cap on the number of batches.

    Raises:
        InvalidInputError: No KV cache in the model, no model to decode with, or bad prompts.
    """
    text = str(source)
    layout = kv_layout(specs)
    if layout is None:
        raise InvalidInputError(format_message(f"Data '{text}'", "prompts for a model without a KV cache",
                                               "a model with past_key_values.{i}.key/value inputs",
                                               "export the causal LM with its cache (the default), or pass an "
                                               ".npz of every model input"))
    if model is None:
        raise InvalidInputError(format_message(f"Data '{text}'", "prompts where no model can decode them",
                                               "an .npz of every model input here"))
    vocab = next((int(s.value_range[1]) for s in specs if s.name == "input_ids" and s.value_range), None)
    prompts, spec = load_prompts(text, vocab)
    steps = spec.steps
    groups = [(i, min(i + batch_size, prompts.count)) for i in range(0, prompts.count, batch_size)]
    plan = [(g, step) for g in groups for step in range(steps + 1)]
    if num_batches is not None:
        plan = plan[:num_batches]
    outputs = layout.output_names
    cache: list[list[dict[str, np.ndarray]]] = []

    def decoded() -> Iterator[dict[str, np.ndarray]]:
        run = model if callable(model) else ort_run_fn(ort_session(model), outputs)
        for lo, hi in dict.fromkeys(g for g, _ in plan):
            last = max(step for g, step in plan if g == (lo, hi))
            for item in greedy_decode(run, layout, prompts.input_ids[lo:hi], prompts.attention_mask[lo:hi], last):
                yield item.feeds

    def gen() -> Iterator[dict[str, np.ndarray]]:
        if cache:
            yield from cache[0]
            return
        held: list[dict[str, np.ndarray]] | None = []
        size = 0
        stream = decoded()
        for feeds in stream:
            if held is None:  # past the cache's size: decoded as read, the session held meanwhile
                yield feeds
                continue
            held.append(feeds)
            size += sum(np.asarray(v).nbytes for v in feeds.values())
            if size > DECODE_CACHE_BYTES:
                yield from held
                held = None
        if held is not None:
            del stream  # the decoding session is closed before any batch is used
            cache.append(held)
            yield from held

    return DecodeFeedSource(
        "prompts", f"{spec.path} ({prompts.count} prompts, prefill + {steps} greedy decode steps)", specs, gen,
        len(plan), sum(hi - lo for (lo, hi), _ in plan), batch_steps=tuple(step for _, step in plan))
