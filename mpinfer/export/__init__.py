"""torch → ONNX export with checker and parity (``mpinfer export``)."""

from mpinfer.api import make_callable
from mpinfer.export.exporter import ExportConfig, ExportResult, export_onnx
from mpinfer.export.loader import LoadedModel, load_model

__all__ = ["ExportConfig", "ExportResult", "LoadedModel", "export_onnx", "load_model"]

# `mpinfer.export(...)` is the API function (mpinfer.api.export); the package stays importable as it is.
make_callable(__name__)
