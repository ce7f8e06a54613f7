"""Checkpoints: reading Hugging Face models, writing and reading the TensorRT-LLM checkpoint format."""
