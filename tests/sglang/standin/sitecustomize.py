"""Loaded by every Python process started with this folder on ``PYTHONPATH`` (the SGLang engine
tests start the server, its scheduler and detokenizer processes that way): SGLang's CPU engine
in a venv that has no ``sgl_kernel`` wheel for the CPU.

- ``sgl_kernel`` resolves to the stand-in package beside this file (torch-native ops registered
  under the op names SGLang looks up; see ``sgl_kernel/__init__.py``).
- The CPU is reported as having AMX tiles, so SGLang takes the CPU path it ships for its
  supported CPUs (Xeons with AMX) on every machine, the CI's included: without it SGLang falls
  back to Triton kernels for some layers (the gated RMS norm of a GDN layer) that cannot run on a
  CPU. Which ops a run calls therefore does not depend on the machine it runs on.
- Modules SGLang imports at module level for other models (``torchvision``, ``sentencepiece``)
  are inert: importable, never called on this path.
- tqdm's lock is a thread lock: its default, a multiprocessing lock, is a named semaphore in
  ``/dev/shm`` that SGLang's scheduler makes when it loads the weights, and SGLang's shutdown
  kills that process and its resource tracker (SIGKILL), so each engine left one behind.

Never imported by radixcache itself."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

_INERT = {"torchvision", "sentencepiece"}


class _Inert(types.ModuleType):
    """An importable module whose attributes are placeholders that raise when called."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__file__ = "<inert>"
        self.__version__ = "0.0.0"

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        value = _Placeholder(f"{self.__name__}.{item}")
        setattr(self, item, value)
        return value


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} was called: it is a placeholder in the SGLang CPU test environment")


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in _INERT:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _Inert(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _InertFinder())

import torch  # noqa: E402

torch.cpu._is_amx_tile_supported = lambda: True

import threading  # noqa: E402

import radixcache_test_hooks  # type: ignore[import-not-found]  # noqa: E402,F401  (extra buffer on the CPU; noise, injected bugs)
import tqdm  # type: ignore[import-untyped]  # noqa: E402

tqdm.tqdm.set_lock(threading.RLock())
