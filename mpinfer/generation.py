"""Greedy generation with a baseline decoder and its candidates (``mpinfer compare --generate N``).

Every model runs through an ONNX Runtime session (CPU unless told otherwise) and decodes with its own KV cache,
feeding each call's ``present.*`` back as the next ``past_key_values.*`` (see :mod:`mpinfer.data.decode`). For
each candidate:

* ``first_divergence``: per prompt, the index of the first generated token where the candidate's own greedy
  continuation differs from the baseline's (``N`` when none does); reported as the mean and the minimum. It is
  read off the teacher-forced decode below: up to the first position where the candidate's forced choice differs
  from the baseline's token, its forced context is its own greedy context, so that position is where its own
  continuation leaves the baseline's (one decode of the candidate, not two);
* ``token_agreement``: with the candidate fed the baseline's continuation (teacher forcing), the share of
  positions where its next-token choice equals the baseline's;
* ``step_cosine``: per step, the mean over prompts of the cosine between the two models' next-token logits
  (teacher-forced, so every step compares the same context);
* perplexity of each model on the baseline's greedy continuation, and the candidate's ratio to the baseline's;
* latency: prefill milliseconds and decode tokens per second. By default they are those of the decodes above
  (every prompt in batches of ``batch_size``, one run each: the baseline's greedy decode and the candidate's
  teacher-forced one); ``latency_batch_sizes`` asks for timed runs at those batch sizes instead (the median of
  :data:`LATENCY_REPEATS` after a warm-up run).

Memory and time at model size: each model file is read once for its inputs (:class:`Decoder`), the prompts once,
and one ONNX Runtime session is alive at a time (the baseline's, closed before the candidate's opens).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.data.decode import KvLayout, Prompts, greedy_decode, kv_layout, load_prompts, ort_run_fn
from mpinfer.errors import InvalidInputError, format_message
from mpinfer.memory import release_memory
from mpinfer.modelio import load_onnx, ort_session
from mpinfer.specs import specs_from_onnx

logger = logging.getLogger(__name__)

# Timed repetitions of each asked-for latency measurement (the median is reported) after one untimed warm-up run.
LATENCY_REPEATS = 5


@dataclass
class DecodeRun:
    """One model's greedy decode of every prompt: chosen tokens and per-step next-token logits."""

    tokens: np.ndarray  # [prompts, N]
    logits: np.ndarray  # [prompts, N, vocab]
    prefill_s: float = 0.0  # seconds in the prefill calls (every batch)
    decode_s: float = 0.0  # seconds in the decode-step calls (every batch)
    batch: int = 0  # prompts per call

    def latency(self) -> dict[str, float]:
        """Prefill ms per batch and decode tokens/s of this run (the figures of :func:`time_decode`)."""
        prompts, steps = self.tokens.shape
        calls = -(-prompts // max(self.batch, 1))
        rate = prompts * (steps - 1) / self.decode_s if steps > 1 and self.decode_s > 0 else 0.0
        return {"prefill_ms": 1000 * self.prefill_s / max(calls, 1), "decode_tokens_per_s": rate}


@dataclass
class GenerationResult:
    """Generation of one candidate against the baseline (see the module docstring for each figure)."""

    candidate: str
    tokens: int
    prompts: int
    first_divergence: list[int]
    token_agreement: float
    step_cosine: list[float]
    ppl_baseline: float
    ppl_candidate: float
    # batch size -> {"baseline" | "candidate": {"prefill_ms": ..., "decode_tokens_per_s": ...}}
    latency: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)

    @property
    def ppl_ratio(self) -> float:
        """The candidate's perplexity over the baseline's (1 is the same)."""
        return self.ppl_candidate / self.ppl_baseline if self.ppl_baseline > 0 else math.inf

    def metrics(self) -> dict[str, float]:
        """Scalar figures by name, for checks and budgets."""
        div = np.asarray(self.first_divergence, dtype=np.float64)
        cos = np.asarray(self.step_cosine, dtype=np.float64)
        return {
            "token_agreement": float(self.token_agreement),
            "first_divergence": float(div.mean()) if div.size else float(self.tokens),
            "first_divergence_min": float(div.min()) if div.size else float(self.tokens),
            "step_cosine_min": float(cos.min()) if cos.size else 1.0,
            "step_cosine_mean": float(cos.mean()) if cos.size else 1.0,
            "ppl_baseline": float(self.ppl_baseline),
            "ppl_candidate": float(self.ppl_candidate),
            "ppl_ratio": float(self.ppl_ratio),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON form (metrics included)."""
        d = asdict(self)
        d["latency"] = {str(k): v for k, v in self.latency.items()}
        d["metrics"] = self.metrics()
        return d


@dataclass(frozen=True)
class GenerateConfig:
    """What to generate with.

    Attributes:
        baseline: The FP32 decoder (ONNX with a KV cache).
        candidates: Converted decoders.
        prompts: ``.npz`` with ``input_ids`` [N, T] (+ optional ``attention_mask``), or ``prompts:FILE[:...]``.
        tokens: Tokens to generate per prompt.
        batch_size: Prompts decoded together.
        latency_batch_sizes: Batch sizes of timed latency runs (default none: the figures of the decodes at
            ``batch_size``).
        providers: ONNX Runtime providers (default CPU).
        checked: What :func:`check_generate` read (prompts and decoders), kept so nothing is read twice.
    """

    baseline: str
    candidates: tuple[str, ...]
    prompts: str
    tokens: int
    batch_size: int = 16
    latency_batch_sizes: tuple[int, ...] = ()
    providers: tuple[str, ...] = ()
    checked: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class KnownCall:
    """A call a session ran already (compare's pass over the data): its feeds, outputs and seconds.

    ``outputs`` holds what a decode reads of them: the last position's ``logits`` and the presents.
    """

    feeds: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    seconds: float


def known_call(layout: KvLayout, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
               seconds: float) -> KnownCall:
    """A :class:`KnownCall` holding only what a decode reads: the last position's logits (a copy) and the presents."""
    kept = {n: np.asarray(outputs[n]) for n in layout.present_names}
    kept["logits"] = np.array(np.asarray(outputs["logits"])[:, -1:])
    return KnownCall(dict(feeds), kept, seconds)


def _same_feeds(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    if a.keys() != b.keys():
        return False
    pairs = [(np.asarray(a[k]), np.asarray(b[k])) for k in a]
    return all(x.dtype == y.dtype and x.shape == y.shape for x, y in pairs) and all(
        np.array_equal(x, y) for x, y in pairs)


class Replay:
    """A :data:`RunFn` answering a call equal to a known one with that call's outputs, and running any other.

    Equal: the same input names, dtypes, shapes and values; each known call answers once. The same session on
    the same feeds gives the same outputs, so the decode's tokens and logits are those it would compute;
    its timing is credited with the seconds the call took when it ran (:meth:`take_credit`).
    """

    def __init__(self, run: Any, known: Sequence[KnownCall], names: Sequence[str]) -> None:
        self.run = run
        self.known = [k for k in known if all(n in k.outputs for n in names)]
        self.names = list(names)
        self.credit = 0.0

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The known call's outputs for feeds equal to its own, else the session's run."""
        start = time.perf_counter()
        hit = next((i for i, k in enumerate(self.known) if _same_feeds(k.feeds, feeds)), None)
        if hit is None:
            return dict(self.run(feeds))
        call = self.known.pop(hit)
        self.credit += call.seconds - (time.perf_counter() - start)
        return {n: call.outputs[n] for n in self.names}

    def take_credit(self) -> float:
        """Seconds to add to the time measured since the last call: the replayed calls' own, less the look-up's."""
        credit, self.credit = self.credit, 0.0
        return credit


class Decoder:
    """A decoder with its KV layout; its ONNX Runtime session opens on :meth:`open` (one model at a time).

    ``path`` is an ONNX file, or an ``onnx.ModelProto`` (convert's candidate as it will be written).
    """

    def __init__(self, path: Any, what: str = "--generate") -> None:
        self.specs = _specs(path)
        layout = kv_layout(self.specs)
        if layout is None:
            name = path if isinstance(path, (str, Path)) else "the model"
            raise InvalidInputError(format_message(f"{what} with '{name}'", "a model without a KV cache",
                                                   "decoders exported with past_key_values.*/present.*",
                                                   "mpinfer export of a causal LM folder adds it (unless --no-past)"))
        self.path = path
        self.layout: KvLayout = layout
        self.run: Any = None

    def open(self, providers: Sequence[str], session: Any = None, known: Sequence[KnownCall] = ()) -> Decoder:
        """Start the session (the model's memory is held from here until :meth:`close`).

        ``session``: an ONNX Runtime session of this model already open (compare's pass over the data), used
        instead of a new one. ``known``: calls that session ran already (with ``session`` only); the next
        :meth:`decode` takes their outputs for equal feeds instead of running them again (:class:`Replay`).
        """
        if session is None:
            session, known = ort_session(self.path, providers=list(providers) or None), ()
        self.run = ort_run_fn(session, self.layout.output_names)
        if known:
            self.run = Replay(self.run, known, self.layout.output_names)
        return self

    def close(self) -> None:
        """Release the session (and the heap it leaves, before the next model's session opens)."""
        self.run = None
        release_memory()

    def decode(self, prompts: Prompts, tokens: int, batch: int, forced: np.ndarray | None = None) -> DecodeRun:
        """Greedy decode of every prompt (``tokens`` chosen each), ``batch`` prompts at a time."""
        all_tokens, all_logits = [], []
        prefill = decode = 0.0
        replay = self.run if isinstance(self.run, Replay) else None
        for lo in range(0, prompts.count, batch):
            hi = min(lo + batch, prompts.count)
            force = None if forced is None else forced[lo:hi]
            rows_t, rows_l = [], []
            stamp = time.perf_counter()
            for s in greedy_decode(self.run, self.layout, prompts.input_ids[lo:hi], prompts.attention_mask[lo:hi],
                                   tokens - 1, forced=force):
                spent = time.perf_counter() - stamp + (replay.take_credit() if replay is not None else 0.0)
                if s.step == 0:
                    prefill += spent
                else:
                    decode += spent
                rows_t.append(s.tokens)
                rows_l.append(s.logits.astype(np.float32))
                stamp = time.perf_counter()
            all_tokens.append(np.stack(rows_t, axis=1))
            all_logits.append(np.stack(rows_l, axis=1))
        if replay is not None:
            self.run = replay.run  # the known calls serve this decode alone (not the timed latency runs after it)
        return DecodeRun(np.concatenate(all_tokens), np.concatenate(all_logits), prefill, decode,
                         min(batch, prompts.count))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


def perplexity(logits: np.ndarray, tokens: np.ndarray) -> float:
    """Exp of the mean negative log-likelihood of ``tokens`` [P, N] under ``logits`` [P, N, vocab].

    One step at a time: float64 temporaries of one step's [P, vocab], not of the whole decode (16 prompts x 32
    steps x 32000 are 131 MB each in float64, beside the candidate's session).
    """
    if not tokens.size:
        return float("nan")
    total = 0.0
    for step in range(tokens.shape[1]):
        logp = _log_softmax(logits[:, step].astype(np.float64))
        total += float(np.take_along_axis(logp, tokens[:, step, None], axis=-1).sum())
    return float(np.exp(-total / tokens.size))


def step_cosines(ref: np.ndarray, cand: np.ndarray) -> list[float]:
    """Per step, the mean over prompts of the cosine between two [P, N, vocab] logits arrays (a step at a time)."""
    out = []
    for step in range(ref.shape[1]):
        r, c = ref[:, step].astype(np.float64), cand[:, step].astype(np.float64)
        num = (r * c).sum(axis=-1)
        den = np.linalg.norm(r, axis=-1) * np.linalg.norm(c, axis=-1)
        out.append(float(np.where(den > 0, num / np.maximum(den, 1e-300), 1.0).mean()))
    return out


def first_divergence(ref: np.ndarray, cand: np.ndarray) -> list[int]:
    """Per prompt, the first position where two [P, N] token arrays differ (N when they never do)."""
    differ = ref != cand
    return [int(np.argmax(row)) if row.any() else int(ref.shape[1]) for row in differ]


def time_decode(model: Decoder, prompts: Prompts, tokens: int, batch: int) -> dict[str, float]:
    """Median prefill ms and decode tokens/s of ``batch`` prompts (tiled when fewer) over a few runs."""
    reps = -(-batch // prompts.count)
    ids = np.tile(prompts.input_ids, (reps, 1))[:batch]
    mask = np.tile(prompts.attention_mask, (reps, 1))[:batch]
    prefill, decode = [], []
    for i in range(LATENCY_REPEATS + 1):
        stamps = [time.perf_counter()]
        for _ in greedy_decode(model.run, model.layout, ids, mask, tokens - 1):
            stamps.append(time.perf_counter())
        if i:  # the first run warms up
            prefill.append(stamps[1] - stamps[0])
            decode.append(stamps[-1] - stamps[1])
    decode_s = float(np.median(decode))
    rate = batch * (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0
    return {"prefill_ms": 1000 * float(np.median(prefill)), "decode_tokens_per_s": rate}


def measure_candidate(cand: Decoder, ref: DecodeRun, prompts: Prompts, tokens: int, batch: int, *,
                      name: str) -> GenerationResult:
    """The generation figures of one open candidate against the baseline's decode ``ref``.

    One teacher-forced decode: ``first_divergence`` is where its choices first differ from the baseline's tokens
    (see the module docstring). The latency is that decode's, beside the baseline's own decode.
    """
    forced = cand.decode(prompts, tokens, batch, forced=ref.tokens)
    return GenerationResult(
        candidate=name, tokens=tokens, prompts=prompts.count,
        first_divergence=first_divergence(ref.tokens, forced.tokens),
        token_agreement=float(np.mean(forced.tokens == ref.tokens)),
        step_cosine=step_cosines(ref.logits, forced.logits),
        ppl_baseline=perplexity(ref.logits, ref.tokens), ppl_candidate=perplexity(forced.logits, ref.tokens),
        latency={ref.batch: {"baseline": ref.latency(), "candidate": forced.latency()}})


def check_generate(cfg: GenerateConfig) -> tuple[Prompts, list[Decoder]]:
    """Check the models (each with a KV cache) and read the prompts, before any model runs.

    Each model's graph is read once here and the prompts are read (tokenized) once; both are returned (and kept
    in ``cfg.checked`` by :func:`generate_config`) for :func:`generate_compare`.

    Returns:
        The prompts, and one :class:`Decoder` per model (the baseline first), none of them open.

    Raises:
        InvalidInputError: ``tokens < 1``, a model without a KV cache, prompts that are missing or do not fit.
    """
    if cfg.checked is not None:
        return cfg.checked  # type: ignore[no-any-return]
    if cfg.tokens < 1:
        raise InvalidInputError(format_message("--generate", cfg.tokens, "a number of tokens >= 1"))
    if str(cfg.prompts).startswith("random"):
        raise InvalidInputError(format_message("--generate", f"--data {cfg.prompts}",
                                               "prompts: an .npz of input_ids [N, T] (or prompts:FILE...)"))
    decoders = [Decoder(path) for path in (cfg.baseline, *cfg.candidates)]
    vocab = next((int(s.value_range[1]) for s in decoders[0].specs if s.name == "input_ids" and s.value_range),
                 None)
    return load_prompts(cfg.prompts, vocab)[0], decoders


class GenerationPass:
    """compare --generate's decodes, model by model: each may run on a session its caller already has open.

    ``mpinfer compare`` hands over each model's session of its pass over the data (:meth:`baseline`, then
    :meth:`candidate`), so a model is loaded once for both; :meth:`finish` decodes with whatever model was not
    handed over, in a session of its own, one model open at a time.
    """

    def __init__(self, cfg: GenerateConfig) -> None:
        self.cfg = cfg
        self.prompts, (self.base, *self.cands) = check_generate(cfg)
        self.ref: DecodeRun | None = None
        self.base_latency: dict[int, dict[str, float]] = {}
        self.results: dict[int, GenerationResult] = {}
        self.seconds = 0.0  # in the decodes (a session handed over is not counted: it was opened for the data)
        self.known: dict[int, list[KnownCall]] = {}  # by model (0: the baseline): calls of the data pass's sessions

    def remember(self, model: int, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
                 seconds: float) -> None:
        """A call of ``model`` (0: the baseline, ``i + 1``: candidate ``i``) its session ran for the data pass.

        Its decode on that session (:meth:`baseline`, :meth:`candidate`) takes the outputs for equal feeds. The
        baseline's every call is kept (the data's batches are its own greedy decode: its generation starts with
        the same calls); a candidate's only with an empty past (a prefill: the data's later batches carry the
        baseline's cache, never the candidate's own).
        """
        layout = (self.base if model == 0 else self.cands[model - 1]).layout
        if not all(n in feeds for n in layout.input_names) or not all(n in outputs for n in layout.output_names):
            return
        if model and any(np.asarray(feeds[n]).size for n in layout.past_names):
            return
        self.known.setdefault(model, []).append(known_call(layout, feeds, outputs, seconds))

    def baseline(self, session: Any = None) -> None:
        """The baseline's greedy decode (and its asked-for latency runs)."""
        cfg, start = self.cfg, time.perf_counter()
        self.base.open(cfg.providers, session, self.known.pop(0, ()))
        self.ref = self.base.decode(self.prompts, cfg.tokens, cfg.batch_size)
        self.base_latency = {b: time_decode(self.base, self.prompts, cfg.tokens, b) for b in cfg.latency_batch_sizes}
        self.base.close()
        self.seconds += time.perf_counter() - start

    def candidate(self, index: int, session: Any = None) -> None:
        """Candidate ``index``'s figures against the baseline's decode (which must have run)."""
        cfg, cand, ref, start = self.cfg, self.cands[index], self.ref, time.perf_counter()
        if ref is None:
            raise RuntimeError("the baseline's decode runs before any candidate's")
        cand.open(cfg.providers, session, self.known.pop(index + 1, ()))
        res = measure_candidate(cand, ref, self.prompts, cfg.tokens, cfg.batch_size, name=cfg.candidates[index])
        if cfg.latency_batch_sizes:
            res.latency = {b: {"baseline": self.base_latency[b],
                               "candidate": time_decode(cand, self.prompts, cfg.tokens, b)}
                           for b in cfg.latency_batch_sizes}
        cand.close()
        self.results[index] = res
        self.seconds += time.perf_counter() - start

    def finish(self) -> list[GenerationResult]:
        """Every candidate's result, in order; the decodes not yet run are run here."""
        if self.ref is None:
            self.baseline()
        for index in range(len(self.cands)):
            if index not in self.results:
                self.candidate(index)
        logger.info("generation of %d tokens for %d prompts with %d model(s) took %.1f s", self.cfg.tokens,
                    self.prompts.count, 1 + len(self.cands), self.seconds)
        return [self.results[i] for i in range(len(self.cands))]


def generate_compare(cfg: GenerateConfig) -> list[GenerationResult]:
    """Greedy generation with the baseline and every candidate on the same prompts, one model open at a time.

    Returns:
        One result per candidate, in order.

    Raises:
        InvalidInputError: See :func:`check_generate`.
    """
    return GenerationPass(cfg).finish()


def attach_generation(result: Any, gen: GenerationPass, checks: Any) -> None:
    """Generate with every candidate of ``result`` (a ComparisonResult) and check the figures with the rest.

    The figures go into ``result.data["generation"]`` (one :meth:`GenerationResult.to_dict` per candidate)
    and each candidate's ``generation`` (what ``generate:``/generation checks read); ``checks`` are evaluated
    again with them. ``gen``: the decodes, some of them run already on the sessions of compare's data pass.
    """
    gens = gen.finish()
    result.data["generation"] = [g.to_dict() for g in gens]
    by_path = {g.candidate: g.metrics() for g in gens}
    for cand in result.candidates:
        cand.generation = by_path.get(cand.path)
        cand.evaluate(checks)


def _specs(path: Any) -> list[Any]:
    if not isinstance(path, (str, Path)):  # a ModelProto
        return specs_from_onnx(path)
    return specs_from_onnx(load_onnx(Path(path), load_external_data=False))


def generate_config(compare: Any, tokens: int) -> GenerateConfig:
    """The generation settings of ``mpinfer compare --generate`` (from its CompareConfig), checked at once.

    Raises:
        InvalidInputError: No ``--data``, or see :func:`check_generate`.
    """
    if not compare.data:
        raise InvalidInputError(format_message("--generate", "no --data", "--data prompts.npz (input_ids [N, T])"))
    cfg = GenerateConfig(baseline=str(compare.baseline), candidates=tuple(compare.candidates),
                         prompts=str(compare.data), tokens=tokens, batch_size=compare.batch_size or 16,
                         latency_batch_sizes=tuple(compare.batch_sizes or ()))
    return replace(cfg, checked=check_generate(cfg))
