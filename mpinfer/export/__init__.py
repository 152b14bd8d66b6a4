"""torch → ONNX export with checker and parity (``mpinfer export``)."""

from mpinfer.export.exporter import ExportConfig, ExportResult, export_onnx
from mpinfer.export.loader import LoadedModel, load_model

__all__ = ["ExportConfig", "ExportResult", "LoadedModel", "export_onnx", "load_model"]
