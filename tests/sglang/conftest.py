"""Tests of the SGLang backend: they run where SGLang 0.5.23 is importable (CI builds a CPU venv
for them, see docs/sglang.md) and are skipped everywhere else, so the main suite never needs
SGLang. SGLang's GPU-only imports (its kernels, torchvision, sentencepiece and the like) are
replaced by inert modules before SGLang is imported: nothing here runs a kernel."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any
from unittest import mock

# Modules SGLang imports at module level that a CPU venv built with --no-deps does not have.
_INERT = {"sgl_kernel", "torchvision", "sentencepiece", "compressed_tensors", "gguf"}


class _Inert(types.ModuleType):
    """A module whose every attribute is a mock: importable, never meant to be called."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__file__ = "<inert>"
        self.__version__ = "0.0.0"

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        value = mock.MagicMock(name=f"{self.__name__}.{item}")
        setattr(self, item, value)
        return value


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if (
            fullname.split(".")[0] in _INERT
            and importlib.machinery.PathFinder.find_spec(fullname.split(".")[0]) is None
        ):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _Inert(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


if importlib.util.find_spec("sglang") is not None:
    sys.meta_path.insert(0, _InertFinder())
