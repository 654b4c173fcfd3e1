"""What every peer shim shares: the ``NoAdapter`` error for a peer call cupyrope has no adapter
for, module-level ``__getattr__`` hooks that raise it, and an import hook that makes unknown
submodules of a shimmed package raise it on first use instead of failing the import."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

# The runner counts a failure as "no adapter" when its message holds this prefix.
MARKER = "no cupyrope adapter for"


class NoAdapter(NotImplementedError):
    """A peer API the test touched that cupyrope.compat does not provide."""

    def __init__(self, name: str, why: str = ""):
        super().__init__(f"{MARKER} {name}" + (f" ({why})" if why else ""))
        self.name = name


def module_getattr(module_name: str):
    """A module ``__getattr__`` raising NoAdapter for every public name the module lacks (dunder
    names raise AttributeError, so ``hasattr`` probes and ``import *`` still work)."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        raise NoAdapter(f"{module_name}.{name}")

    return __getattr__


class _MissingModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``root.x.y`` that no shim file provides give an empty module whose attributes
    raise NoAdapter: the test fails (or errors at collection) naming what it needed."""

    def __init__(self, roots):
        self.roots = tuple(roots)

    def find_spec(self, fullname, path=None, target=None):
        if "." not in fullname or fullname.split(".")[0] not in self.roots:
            return None
        for finder in sys.meta_path:  # a real file wins
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            if finder.find_spec(fullname, path, target) is not None:
                return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


def install_missing_module_finder(*roots: str) -> None:
    """Append (once per root set) the finder for unknown submodules of ``roots``."""
    for finder in sys.meta_path:
        if isinstance(finder, _MissingModuleFinder) and set(roots) <= set(finder.roots):
            return
    sys.meta_path.append(_MissingModuleFinder(roots))
