"""Batch types dispatch splits and joins: the public table (see :mod:`podium.core.batching`).

``register_batch_type(MyBatch, length=..., chunk=..., concat=..., pad=..., unpad=...)``
makes ``MyBatch`` arguments split over DP ranks and ``MyBatch`` results
concatenated, exactly as ``DataProto`` is.
"""

from podium.core.batching import (
    NotABatchError,
    auto_padding,
    can_pad,
    chunk,
    concat,
    is_batch,
    length,
    pad,
    register_batch_type,
    split,
    unpad,
)

__all__ = [
    "NotABatchError",
    "auto_padding",
    "can_pad",
    "chunk",
    "concat",
    "is_batch",
    "length",
    "pad",
    "register_batch_type",
    "split",
    "unpad",
]
