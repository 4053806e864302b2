"""Import-only torchvision stub for CPU torch (PyPI torchvision wheels are CUDA-linked)."""

import enum
import importlib.abc
import importlib.machinery
import sys
import types


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Dummy:
    def __init__(self, name):  # type: ignore[no-untyped-def]
        self._n = name

    def __call__(self, *a, **k):  # type: ignore[no-untyped-def]
        raise RuntimeError(f"torchvision stub: {self._n} called")

    def __getattr__(self, a):  # type: ignore[no-untyped-def]
        return _Dummy(f"{self._n}.{a}")

    def __mro_entries__(self, bases):  # type: ignore[no-untyped-def]
        return (object,)


class _Mod(types.ModuleType):
    def __getattr__(self, a):  # type: ignore[no-untyped-def]
        if a.startswith("__"):
            raise AttributeError(a)
        if a == "InterpolationMode":
            return InterpolationMode
        return _Dummy(f"{self.__name__}.{a}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        m = _Mod(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0+stub"
        return m

    def exec_module(self, m):  # type: ignore[no-untyped-def]
        pass


sys.meta_path.insert(0, _Finder())
