"""Quantization: pure tensor functions now; the `quantize` stage (methods, calibration, checkpoint layout) builds
on them (see docs/research/trtllm-quantized-layouts.md)."""
