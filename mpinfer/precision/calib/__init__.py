"""The FP32 reference run: bounded-memory capture of tensors, per-tensor statistics, calibration."""
