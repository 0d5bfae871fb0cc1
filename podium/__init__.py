"""podium: one controller process driving groups of distributed PyTorch workers.

The same trainer runs on Ray or on torchrun/torchx by changing one setting
(``backend=`` or ``$PODIUM_BACKEND``). Import everything from here; the
modules under ``podium.core`` are internal and may change.
"""

from podium.core.backend import (
    Backend,
    BackendGroup,
    Capabilities,
    available_backends,
    load_backend,
)
from podium.core.batching import register_batch_type
from podium.core.batchref import BatchRef
from podium.core.decorator import (
    DISPATCH_MODE_FN_REGISTRY,
    Dispatch,
    Execute,
    get_predefined_dispatch_fn,
    get_predefined_execute_fn,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from podium.core.dispatch import make_nd_compute_dataproto_dispatch_fn
from podium.core.futures import DataProtoFuture, RankFuture, get
from podium.core.modes import Dispatched
from podium.core.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from podium.core.protocol_config import DataProtoConfig
from podium.core.resource import (
    ResourcePool,
    merge_resource_pool,
    split_resource_pool,
)
from podium.core.resource_manager import ResourcePoolManager
from podium.core.worker import (
    ClassWithInitArgs,
    Worker,
    create_colocated_worker_cls,
    create_colocated_worker_raw_cls,
)
from podium.core.worker_group import WorkerGroup
from podium.errors import (
    CallTimeoutError,
    DataLostError,
    DataProtoError,
    DispatchError,
    GroupShutdownError,
    PodiumError,
    RemoteError,
    ResourceUnavailableError,
    UnknownBackendError,
    WorkerDiedError,
    WorkerStartupError,
)

__version__ = "0.1.0"

__all__ = [
    "DISPATCH_MODE_FN_REGISTRY",
    "Backend",
    "BackendGroup",
    "BatchRef",
    "CallTimeoutError",
    "Capabilities",
    "ClassWithInitArgs",
    "DataLostError",
    "DataProto",
    "DataProtoConfig",
    "DataProtoError",
    "DataProtoFuture",
    "Dispatch",
    "Dispatched",
    "DispatchError",
    "Execute",
    "GroupShutdownError",
    "PodiumError",
    "RankFuture",
    "RemoteError",
    "ResourcePool",
    "ResourcePoolManager",
    "ResourceUnavailableError",
    "UnknownBackendError",
    "Worker",
    "WorkerDiedError",
    "WorkerGroup",
    "WorkerStartupError",
    "__version__",
    "available_backends",
    "create_colocated_worker_cls",
    "create_colocated_worker_raw_cls",
    "get",
    "get_predefined_dispatch_fn",
    "get_predefined_execute_fn",
    "load_backend",
    "make_nd_compute_dataproto_dispatch_fn",
    "merge_resource_pool",
    "pad_dataproto_to_divisor",
    "register",
    "register_batch_type",
    "register_dispatch_mode",
    "split_resource_pool",
    "unpad_dataproto",
    "update_dispatch_mode",
]
