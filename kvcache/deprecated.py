"""Old public names kept for one release after a rename, each warning when it is used.

Issue 21's glossary renamed types whose old names misled (``GPUCacheContext`` serves CPU
caches too). Code written against the old names keeps working for one release: a module
lists its old names with ``renamed(__name__, {"Old": "New"})`` as its module ``__getattr__``,
so the old name resolves to the new object and a ``DeprecationWarning`` names the
replacement at the caller's line. Nothing in kvcache itself uses an old name.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

_F = TypeVar("_F", bound=Callable[..., Any])

# The release that drops the aliases: one after the one that renamed them.
REMOVED_IN = "0.2.0"


def renamed(module: str, names: Mapping[str, str], *, stacklevel: int = 2) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves each old name in ``names`` to its new one.

    ``stacklevel`` 3 when a module's own ``__getattr__`` calls it rather than being it, so
    the warning still points at the line that used the old name."""
    table = dict(names)

    def __getattr__(name: str) -> Any:
        new = table.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is deprecated and will be removed in kvcache {REMOVED_IN}; use {module}.{new}",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        return getattr(sys.modules[module], new)

    return __getattr__


def renamed_keyword(old: str, new: str, convert: Callable[[Any], Any]) -> Callable[[_F], _F]:
    """Let a function still take its keyword ``old`` (renamed to ``new``) for one release:
    the value goes through ``convert`` (say a float moment to a ``Deadline``) and the call
    warns. Passing both is a ``TypeError``, as for any repeated argument."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{fn.__qualname__}() got both {old!r} and {new!r}")
                warnings.warn(
                    f"{fn.__qualname__}({old}=...) is deprecated and will be removed in kvcache "
                    f"{REMOVED_IN}; use {new}=",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = convert(kwargs.pop(old))
            return fn(*args, **kwargs)

        return cast(_F, call)

    return wrap


__all__ = ["REMOVED_IN", "renamed", "renamed_keyword"]
