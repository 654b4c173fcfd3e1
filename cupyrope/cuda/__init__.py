"""The CUDA side of a checked plan: NVRTC compilation, launch geometry and parameters, repeat-call
recipes and programmatic dependent launch."""
