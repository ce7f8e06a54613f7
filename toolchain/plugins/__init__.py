"""The TensorRT plugins' kernels: Triton sources (kernels/), their ahead-of-time compile to PTX and cubin per SM
(compile.py, ptx.py), their TensorRT registration and launch description."""
