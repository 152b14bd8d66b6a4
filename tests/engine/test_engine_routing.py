"""Version routing, backend choice and GPU refusals: pure decisions tested with hand-written facts."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpinfer.engine.build import TensorRTProbe, default_output, select_backend
from mpinfer.engine.config import Backend
from mpinfer.engine.machine import check_capability, tensorrt_major
from mpinfer.engine.trt_builder import ParserIssue, format_parser_errors, plan_network_mode
from mpinfer.errors import BackendUnavailableError, InvalidInputError
from mpinfer.specs import Precision


@pytest.mark.parametrize("version", ["10.0.1", "10.13.3.9", "10.16.1"])
def test_tensorrt_10_builds_strongly_typed_with_the_flag(version):
    mode = plan_network_mode(version)
    assert mode.strongly_typed and mode.network_flags == ("STRONGLY_TYPED",) and mode.builder_flags == ()
    assert mode.label == "strongly-typed"


@pytest.mark.parametrize("version", ["11.0.0", "11.4.1", "12.0.0"])
def test_tensorrt_11_is_strongly_typed_without_any_flag(version):
    mode = plan_network_mode(version)
    # STRONGLY_TYPED is deprecated and ignored on 11: strong typing is the only mode.
    assert mode.strongly_typed and mode.network_flags == () and mode.builder_flags == ()


def test_tensorrt_10_offers_weak_flags_with_a_deprecation_note():
    mode = plan_network_mode("10.13.0", [Precision.FP16, Precision.BF16])
    assert not mode.strongly_typed and mode.network_flags == ()
    assert mode.builder_flags == ("FP16", "BF16") and mode.label == "weak (fp16, bf16)"
    assert "deprecated since TensorRT 10.12" in mode.notes[0]


def test_tensorrt_11_refuses_weak_flags_and_says_why():
    with pytest.raises(InvalidInputError) as info:
        plan_network_mode("11.0.0", [Precision.FP16])
    msg = str(info.value)
    assert msg.startswith("--fp16 (weak typing): received TensorRT 11.0.0, expected TensorRT 10.x")
    assert "TensorRT 11 removed weak typing" in msg and "mpinfer convert" in msg


@pytest.mark.parametrize("version", ["8.6.1", "9.3.0"])
def test_tensorrt_before_10_is_refused(version):
    with pytest.raises(BackendUnavailableError, match=f"version {version}.*10.0 or newer.*NVIDIA.s package index"):
        plan_network_mode(version)


def test_tensorrt_major_rejects_garbage():
    assert tensorrt_major("10.13.0.35") == 10
    with pytest.raises(InvalidInputError):
        tensorrt_major("unknown")


TRT = TensorRTProbe("10.13.0")
NO_TRT = TensorRTProbe(None, "no tensorrt")


@pytest.mark.parametrize(
    ("requested", "device", "probe", "gpus", "backend", "why"),
    [
        (Backend.AUTO, "auto", TRT, 1, Backend.TENSORRT, "TensorRT 10.13.0 and a CUDA GPU"),
        (Backend.AUTO, "auto", NO_TRT, 1, Backend.ONNXRUNTIME, "TensorRT is not installed.*NVIDIA.s package index"),
        (Backend.AUTO, "auto", TRT, 0, Backend.ONNXRUNTIME, "no CUDA GPU is visible"),
        (Backend.AUTO, "cpu", TRT, 1, Backend.ONNXRUNTIME, "--device cpu"),
        (Backend.TENSORRT, "auto", NO_TRT, 0, Backend.TENSORRT, "--backend tensorrt"),
        (Backend.ONNXRUNTIME, "auto", TRT, 1, Backend.ONNXRUNTIME, "--backend onnxruntime"),
    ],
)
def test_select_backend(requested, device, probe, gpus, backend, why):
    got, reason = select_backend(requested, device, tensorrt=probe, gpu_count=gpus)
    assert got is backend
    assert pytest.importorskip("re").search(why, reason), reason


def test_default_output_names():
    assert default_output(Path("out/m.fp16.onnx"), Backend.TENSORRT) == Path("out/m.fp16.engine")
    assert default_output(Path("out/m.fp16.onnx"), Backend.ONNXRUNTIME) == Path("out/m.fp16.ort")


def test_bf16_needs_ampere():
    with pytest.raises(
        BackendUnavailableError, match=r"Tesla T4 \(compute capability 7.5\).*bf16.*8.0 or newer"
    ):
        check_capability({Precision.BF16}, (7, 5), "Tesla T4")
    assert check_capability({Precision.BF16, Precision.FP16}, (8, 0), "A100") == []


def test_fp16_needs_native_half_arithmetic():
    with pytest.raises(BackendUnavailableError, match=r"compute capability 5.2.*5.3 or newer for fp16"):
        check_capability({Precision.FP16}, (5, 2), "GTX 980")
    warnings = check_capability({Precision.FP16}, (6, 1), "GTX 1080")
    assert len(warnings) == 1 and "no tensor cores" in warnings[0]
    assert check_capability({Precision.FP16}, (7, 5), "T4") == []
    assert check_capability(set(), (3, 5), "K40") == []  # an fp32 model runs anywhere


def test_parser_errors_name_the_onnx_nodes():
    issues = [ParserIssue(3, "Conv_3", "Conv", "UNSUPPORTED_NODE", "no kernel for bf16 input")]
    issues += [ParserIssue(i, f"Add_{i}", "Add", "INVALID_NODE", "bad") for i in range(10, 16)]
    msg = format_parser_errors(Path("m.onnx"), issues)
    assert msg.startswith(
        "TensorRT's ONNX parser rejected 'm.onnx': received 7 error(s): node 'Conv_3' (Conv): "
        "no kernel for bf16 input [UNSUPPORTED_NODE]"
    )
    assert (
        "(and 2 more)" in msg and "Add_13" in msg and "Add_14" not in msg and "--backend onnxruntime" in msg
    )


def test_parser_issue_from_a_binding_object_without_node_info():
    class ParserErrorLike:  # the shape of tensorrt.ParserError for an error that is not about a node
        def code(self):
            return "MODEL_DESERIALIZE_FAILED"

        def desc(self):
            return "protobuf parse failed"

        def node(self):
            return -1

    issue = ParserIssue.from_trt(ParserErrorLike())
    assert str(issue) == "graph: protobuf parse failed [MODEL_DESERIALIZE_FAILED]"
