"""The CUDA plugins: compiling plugins/*.cu with NVRTC, their TensorRT registration, launching them for checks."""
