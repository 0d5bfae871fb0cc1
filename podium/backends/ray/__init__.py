"""The Ray backend (``backend="ray"``): placement groups, actors and the object store.

Install with ``pip install 'podium[ray]'``.
"""

try:
    import ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("podium's Ray backend needs Ray: pip install 'podium[ray]'") from exc

from podium.backends.ray.backend import RayBackend
from podium.backends.ray.group import RayHandles

__all__ = ["RayBackend", "RayHandles"]
