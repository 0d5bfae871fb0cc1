"""The torchrun backend: workers launched by torchrun through torchx, driven over CURVE-secured ZeroMQ.

Install with ``pip install 'podium[torchrun]'``. The backend class is imported
lazily, so the worker entry point (:mod:`.worker`) starts without loading the
controller's side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from podium.backends.torchrun.backend import TorchrunBackend
    from podium.backends.torchrun.group import TorchrunHandles

__all__ = ["TorchrunBackend", "TorchrunHandles"]


def __getattr__(name: str) -> Any:
    if name == "TorchrunBackend":
        from podium.backends.torchrun.backend import TorchrunBackend

        return TorchrunBackend
    if name == "TorchrunHandles":
        from podium.backends.torchrun.group import TorchrunHandles

        return TorchrunHandles
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
