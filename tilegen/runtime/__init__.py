"""Launchers that run compiled C++ kernels on torch tensors (CUDA driver API, HIP)."""
