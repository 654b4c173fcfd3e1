"""The framework-free host side: array descriptions, dtypes, argument checks, the kernels' ABI
mirror, frequency schedules, the checked plan of a call (fused ops too) and the NumPy path."""
