"""CPU TEST SHIM: an importable stand-in `torchvision` for the lean SGLang install (tests/sglang/support/README.md).

SGLang and transformers import torchvision (sub)modules at module level for multimodal models the tests never
use; a real torchvision wheel would replace the CPU torch. Every `torchvision.*` submodule and name resolves to
an inert placeholder that raises `NotImplementedError` only when called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+test-stub"


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(f"torchvision stub: {cls.__qualname__} is not available")


def _placeholder(name: str) -> type:
    return _PlaceholderMeta(name, (), {"__qualname__": name})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


sys.meta_path.insert(0, _Finder())


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _placeholder(f"torchvision.{name}")
