"""verl's ``verl.protocol`` names, as podium provides them: ``from podium.protocol import ...``.

A verl trainer that imports from ``verl.protocol`` ports by importing from here
instead; the deliberate differences are listed in ``docs/porting-from-verl.md``.
Everything here is also reachable from its home (``podium`` for the classes).
"""

from podium.core.futures import DataProtoFuture
from podium.core.protocol import (
    DataProto,
    DataProtoItem,
    pad_dataproto_to_divisor,
    unpad_dataproto,
)
from podium.core.protocol_config import DataProtoConfig
from podium.core.protocol_ops import (
    all_gather_data_proto,
    collate_fn,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    serialize_single_tensor,
    serialize_tensordict,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
)
from podium.errors import DataProtoError

__all__ = [
    "DataProto",
    "DataProtoConfig",
    "DataProtoError",
    "DataProtoFuture",
    "DataProtoItem",
    "all_gather_data_proto",
    "collate_fn",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "fold_batch_dim",
    "pad_dataproto_to_divisor",
    "serialize_single_tensor",
    "serialize_tensordict",
    "unfold_batch_dim",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
]
