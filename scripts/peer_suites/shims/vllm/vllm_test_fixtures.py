"""pytest fixtures of vLLM's test conftest that its kernel tests request: ``dist_init`` (a
distributed setup the single-GPU kernel tests do not use) and ``default_vllm_config`` (a
config object; the kernel ops here read none of it)."""

import types

import pytest


@pytest.fixture
def dist_init():
    yield None


@pytest.fixture
def default_vllm_config():
    yield types.SimpleNamespace(compilation_config=types.SimpleNamespace(custom_ops=["all"]))
