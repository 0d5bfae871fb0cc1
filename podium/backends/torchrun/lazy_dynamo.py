"""Keep ``torch._dynamo`` out of a worker until something compiles.

``import podium`` pulls in tensordict, whose modules call
``torch.compiler.allow_in_graph`` and ``assume_constant_result`` at import
time. Each call imports ``torch._dynamo`` -- ~0.8 s of CPU per process, the
largest part of a worker's start on a small host, where four workers start
on two cores and start-up is CPU-bound. Both functions only record the
callable they are given for Dynamo's tracer and return it unchanged, so
until Dynamo is imported they can just note it: :func:`install` swaps in
versions that queue the callable, and the moment anything imports
``torch._dynamo`` (``torch.compile``, a user's own import) the queued
callables are registered with the real functions, which are put back.
Tracing therefore sees exactly the registrations it would have seen.

Only podium's worker process calls :func:`install`, before it imports torch;
the controller (the user's process) is left alone.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["install"]

_DYNAMO = "torch._dynamo"
_DEFERRED = ("allow_in_graph", "assume_constant_result")


class _Deferral(importlib.abc.MetaPathFinder):
    """Queues registrations until ``torch._dynamo`` has been imported, then replays them."""

    def __init__(self, compiler: ModuleType) -> None:
        self.compiler = compiler
        self.originals: dict[str, Callable[..., Any]] = {
            name: getattr(compiler, name) for name in _DEFERRED
        }
        self.pending: list[tuple[str, Any]] = []
        self.ready = False
        for name in _DEFERRED:
            setattr(compiler, name, self._deferred(name))

    def _deferred(self, name: str) -> Callable[[Any], Any]:
        def deferred(fn: Any) -> Any:
            # Lists and non-callables get the real function (and its checks).
            if self.ready or not callable(fn):
                return self.originals[name](fn)
            self.pending.append((name, fn))
            return fn

        deferred.__name__ = name
        deferred.__doc__ = self.originals[name].__doc__
        return deferred

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _DYNAMO:
            return None
        sys.meta_path.remove(self)  # find the real spec with the other finders
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            self._replay()  # cannot hook the load: register now (imports Dynamo)
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            try:
                run(module)
            except BaseException:
                sys.meta_path.insert(0, self)  # a later import tries again
                raise
            self._replay()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def _replay(self) -> None:
        self.ready = True
        for name, original in self.originals.items():
            setattr(self.compiler, name, original)
        pending, self.pending = self.pending, []
        for name, fn in pending:
            self.originals[name](fn)


def install() -> None:
    """Defer ``torch._dynamo`` in this process (call before anything imports torch)."""
    if _DYNAMO in sys.modules or "torch" in sys.modules:
        return
    try:
        import torch.compiler
    except ImportError:
        return
    if _DYNAMO in sys.modules or not all(hasattr(torch.compiler, n) for n in _DEFERRED):
        return
    sys.meta_path.insert(0, _Deferral(torch.compiler))
