"""Quantization: pure tensor functions now; the `quantize` stage (methods, calibration, checkpoint layout) builds
on them (see docs/research/trtllm-quantized-layouts.md)."""

# what `trtbuild quantize --format` writes (importable without torch: the CLI's choices): our TensorRT-LLM
# checkpoint, or ModelOpt's unified Hugging Face one (hf_export.py)
FORMATS = ("trtllm", "hf")
