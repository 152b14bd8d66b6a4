#!/usr/bin/env bash
# GPU truth (issue 30): measure on a lent GPU machine as it is, with what bench/gpu_prepare.py made on a CPU.
# bench/GPU.md is the runbook (the device calls, their carry lists and time limits).
#
#   bench/gpu_check.sh piece              copy the carried .ortgpuN/ wheel pieces to /tmp/gpu/pieces
#   bench/gpu_check.sh install            piece, then reassemble the onnxruntime-gpu wheel (sha256 checked) and
#                                         install it with --target /tmp/ortgpu; prints ONNX Runtime's providers
#   bench/gpu_check.sh measure [--dry-run] [--models DIR] [--out DIR] [--steps env,unpack,...]
#                                         every step of bench/gpu_measure.py under its own time limit, then
#                                         results.json + results.md in --out (default $OUT, else out/gpu)
#
# --dry-run: on a CPU, ONNX Runtime's CPU provider, a few iterations, AMP on CPU bf16 (tests/test_gpu_check.py).
# Environment: PY (default python3), GPU_TMP (default /tmp/gpu), GPU_WORK (default $GPU_TMP/work), GPU_LIMITS
# (per-step time limits, "convert=200,amp=120").
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
GPU_LIMITS="${GPU_LIMITS:-}"
TMPD="${GPU_TMP:-/tmp/gpu}"
WORK="${GPU_WORK:-$TMPD/work}"
ORT_TARGET="$TMPD/ortgpu"
MODE="${1:-measure}"; shift || true

copy_pieces() {
    mkdir -p "$TMPD/pieces"
    local found=0
    for d in .ortgpu*/; do
        [ -d "$d" ] || continue
        cp "$d"/* "$TMPD/pieces/" && found=1
    done
    [ "$found" = 1 ] || echo "no .ortgpuN/ folder in this call's tree (carry one)"
    ls -l "$TMPD/pieces"
}

install_wheel() {
    copy_pieces
    local info="$TMPD/pieces/wheel.json"
    [ -f "$info" ] || { echo "no wheel.json among the pieces: run bench/gpu_prepare.py --wheel and carry .ortgpuN/"; return 2; }
    local name sha count have
    name=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['name'])" "$info")
    sha=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['sha256'])" "$info")
    count=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['pieces'])" "$info")
    have=$(ls "$TMPD/pieces/$name".part* 2>/dev/null | wc -l)
    if [ "$have" != "$count" ]; then
        echo "have $have of $count pieces of $name: carry the missing .ortgpuN/ (the machine may have been given back)"
        return 2
    fi
    cat $(ls "$TMPD/pieces/$name".part* | sort) > "$TMPD/$name"  # part00, part01, ...: their order
    echo "$sha  $TMPD/$name" | sha256sum -c - || return 2
    rm -rf "$ORT_TARGET"
    if ! timeout 120 "$PY" -m pip install -q --no-deps --no-index --target "$ORT_TARGET" "$TMPD/$name"; then
        echo "pip install failed: unpacking the wheel instead (a wheel is a zip of the installed files)"
        timeout 120 "$PY" -m zipfile -e "$TMPD/$name" "$ORT_TARGET" || return 2
    fi
    setup_env
    timeout 120 "$PY" bench/gpu_measure.py smoke || return 2
}

setup_env() {
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if [ -d "$ORT_TARGET/onnxruntime" ]; then
        export PYTHONPATH="$ORT_TARGET:$PYTHONPATH"
    fi
    local nv libs
    nv=$("$PY" -c "import nvidia, os; print(os.pathsep.join(nvidia.__path__))" 2>/dev/null || true)
    if [ -n "$nv" ]; then
        libs=$(find ${nv//:/ } -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u | paste -sd: -)
        [ -n "$libs" ] && export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
}

measure() {
    local dry="" models=".gpumodels" out="${OUT:-out/gpu}" steps="env,unpack,latency,accuracy,decode,convert,amp,gputests"
    while [ $# -gt 0 ]; do
        case "$1" in
            --dry-run) dry="--dry-run" ;;
            --models) models="$2"; shift ;;
            --out) out="$2"; shift ;;
            --steps) steps="$2"; shift ;;
            *) echo "unknown option $1"; return 2 ;;
        esac
        shift
    done
    [ -f "$models/manifest.json" ] || { echo "no $models/manifest.json: carry .gpumodels (bench/gpu_prepare.py)"; return 2; }
    setup_env
    mkdir -p "$out" "$WORK"
    # time limits (s): together 480, so a measuring call fits 8 of its 10 minutes; GPU_LIMITS="convert=200,..."
    # overrides them for a rerun of single steps
    declare -A LIMIT=([env]=30 [unpack]=45 [latency]=100 [accuracy]=60 [decode]=45 [convert]=80 [amp]=80 [gputests]=40)
    local kv
    for kv in ${GPU_LIMITS//,/ }; do LIMIT[${kv%%=*}]=${kv#*=}; done
    local rc=0 step
    for step in ${steps//,/ }; do
        echo "== $step (limit ${LIMIT[$step]:-60} s)"
        timeout -k 5 "${LIMIT[$step]:-60}" "$PY" bench/gpu_measure.py "$step" --models "$models" --work "$WORK" \
            --out "$out" $dry 2>&1 | tail -n 25
        local s=${PIPESTATUS[0]}
        if [ "$s" -ne 0 ]; then
            rc=1
            [ "$s" -ge 124 ] && echo "{\"error\": \"timed out after ${LIMIT[$step]:-60} s\"}" > "$out/$step.json"
        fi
    done
    timeout 30 "$PY" bench/gpu_measure.py summarize --models "$models" --work "$WORK" --out "$out" $dry
    cat "$out/results.md"
    return $rc
}

case "$MODE" in
    piece) copy_pieces ;;
    install) install_wheel ;;
    measure) measure "$@" ;;
    *) echo "usage: bench/gpu_check.sh piece|install|measure [--dry-run] [--models DIR] [--out DIR] [--steps LIST]"; exit 2 ;;
esac
