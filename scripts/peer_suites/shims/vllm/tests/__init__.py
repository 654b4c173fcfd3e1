"""The helpers of vLLM's ``tests`` package that its kernel tests import."""
