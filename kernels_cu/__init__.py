"""CUDA C++ sources of cupyrope's kernels (rope.cu and its .cuh headers), shipped as package data."""
