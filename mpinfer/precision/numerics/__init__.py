"""How a candidate runs: the Evaluator protocol and registry (strict, ONNX Runtime CPU/CUDA, TensorRT), the probe."""
