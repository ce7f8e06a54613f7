"""Engines: the I/O contract, ONNX export, plugin reference ops, the CPU and TensorRT backends, build."""
