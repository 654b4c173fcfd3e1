"""The repository's ``scripts/`` as modules for the tests (skipped where an installed copy of the
tests runs without them)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def load(name: str):
    """``scripts/<name>.py`` imported as the module ``name``, or the calling test module skipped
    when this checkout has no such script."""
    path = os.path.join(SCRIPTS, f"{name}.py")
    if not os.path.exists(path):
        pytest.skip(f"scripts/{name}.py is not in this checkout", allow_module_level=True)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
