"""The process-wide auto-padding switch of :class:`podium.DataProto` (verl's ``DataProtoConfig``).

Dispatch pads a batch that does not divide by the DP size when padding is
enabled for it: by the batch's own flag (``DataProto(..., auto_padding=True)``,
``data.auto_padding = True``) or, for every ``DataProto``, by this switch::

    DataProtoConfig.auto_padding = True        # in the controller

or the environment variable ``PODIUM_AUTO_PADDING=1`` (verl's
``VERL_AUTO_PADDING=1`` is honoured too). The switch is read where dispatch
splits the batch -- the controller -- at the time of the call.
"""

from __future__ import annotations

import os
from typing import Any

from podium.errors import DataProtoError

__all__ = ["AUTO_PADDING_ENV", "DataProtoConfig"]

#: Environment variables that turn auto padding on for every DataProto ("1"/"true").
AUTO_PADDING_ENV = ("PODIUM_AUTO_PADDING", "VERL_AUTO_PADDING")

_TRUE = {"1", "TRUE", "YES", "ON"}


class _DataProtoConfigMeta(type):
    """Makes ``auto_padding`` a validated class-level property."""

    _auto_padding: bool = False

    @property
    def auto_padding(cls) -> bool:
        """Whether every DataProto may be padded by dispatch (the switch or the environment)."""
        if cls._auto_padding:
            return True
        return any(os.environ.get(name, "").strip().upper() in _TRUE for name in AUTO_PADDING_ENV)

    @auto_padding.setter
    def auto_padding(cls, enabled: Any) -> None:
        if not isinstance(enabled, bool):
            raise DataProtoError(
                f"DataProtoConfig.auto_padding must be a bool, got {enabled!r} ({type(enabled).__name__})"
            )
        cls._auto_padding = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide DataProto settings; ``DataProtoConfig.auto_padding`` is the only one.

    ``auto_padding_key`` is the ``meta_info`` key verl uses to mark one batch as
    paddable; podium honours it beside its own ``DataProto.auto_padding`` flag.
    """

    auto_padding_key = "_verl_auto_padding"
