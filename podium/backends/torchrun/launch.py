"""Turning a pool into a torchx app that runs torchrun, and running it.

A pool ``[n, n, ...]`` (``k`` entries) becomes one torchx role with ``k``
replicas, each running ``torchrun --nnodes k --nproc-per-node n`` -- the
shape of torchx's ``dist.ddp`` component -- and torchrun runs podium's worker
entry point. torchrun must run the same number of processes on every node,
so a pool with unequal entries is refused.

The agents meet through podium's static rendezvous (:mod:`.rendezvous`: no
pickle, a store that listens on the rendezvous address only). On a local
scheduler that address is ``127.0.0.1`` and gloo's and NCCL's sockets are
bound to the loopback interface too, so nothing of the group listens beyond
this host. On a multi-node scheduler the store listens on node 0's address
and torch.distributed's traffic must stay on a trusted network (see
``docs/trust-model.md``).

torchx substitutes its macros in every argument and environment value with
``string.Template`` (``$$`` becomes ``$``): every value podium hands it is
escaped (:func:`escape`).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchx.runner import Runner
    from torchx.specs import AppDef

    from podium.core.resource import ResourcePool

__all__ = [
    "BOOT",
    "LAUNCH",
    "WORKER_MODULE",
    "app_for_pool",
    "check_pool_shape",
    "escape",
    "free_port",
    "make_runner",
]

WORKER_MODULE = "podium.backends.torchrun.worker"
# What each torchrun process runs (``python -u -c BOOT``): the worker module's
# file, found on the worker's host and loaded by path, so that the process
# does not import the ``podium`` package (torch, tensordict) before it forks
# its worker -- see the worker module's docstring.
BOOT = (
    "import importlib.util as u, os; "
    "d = u.find_spec('podium').submodule_search_locations[0]; "
    "s = u.spec_from_file_location('podium_torchrun_worker', "
    "os.path.join(d, 'backends', 'torchrun', 'worker.py')); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); m.main()"
)
# What each node's agent runs (``python -c LAUNCH <torchrun arguments>``):
# torchrun with podium's rendezvous registered, loaded by path as BOOT does.
LAUNCH = (
    "import importlib.util as u, os, sys; "
    "d = u.find_spec('podium').submodule_search_locations[0]; "
    "s = u.spec_from_file_location('podium_torchrun_rendezvous', "
    "os.path.join(d, 'backends', 'torchrun', 'rendezvous.py')); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); m.main(sys.argv[1:])"
)
# Interface variables that bind torch.distributed's sockets to loopback on a
# local scheduler (unless the user chose an interface).
_LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
ROLE_NAME = "podium"


def check_pool_shape(pool: ResourcePool) -> tuple[int, int]:
    """``(nnodes, nproc_per_node)`` of ``pool``, or a ``ValueError`` saying how to fix it."""
    nodes = pool.process_on_nodes
    if len(set(nodes)) != 1:
        raise ValueError(
            f"the torchrun backend runs the same number of processes on every node "
            f"(torchrun's --nproc-per-node), but this pool asks for {nodes}. Use a pool whose "
            f"entries are equal (e.g. ResourcePool([{max(nodes)}] * {len(nodes)})), or one group "
            "per distinct node size."
        )
    return len(nodes), nodes[0]


def visible_devices(pool: ResourcePool) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` each node of ``pool`` needs, or ``None`` for a whole pool.

    A pool split out of a larger one owns only some slots of each node; its
    ranks must see those devices only. Every node must own the same slots, since
    a torchx role has one environment for all its replicas.
    """
    if not pool.use_gpu or pool.is_root:
        return None
    per_node: dict[tuple[int, int], list[int]] = {}
    for slot in pool.slots:
        per_node.setdefault((slot.root.uid, slot.node), []).append(slot.local)
    lists = {tuple(v) for v in per_node.values()}
    if len(lists) != 1:
        raise ValueError(
            f"this split pool holds different GPU slots on different nodes ({sorted(lists)}); the "
            "torchrun backend gives every node one CUDA_VISIBLE_DEVICES. Split the pool on node "
            "boundaries or so that every node keeps the same slots."
        )
    return ",".join(str(i) for i in lists.pop())


def escape(value: str) -> str:
    """``value`` as torchx must be given it to hand it on unchanged (its macros use ``$``)."""
    return value.replace("$", "$$")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def app_for_pool(
    pool: ResourcePool,
    *,
    name: str,
    env: Mapping[str, str],
    python: str | None = None,
    rdzv_port: int | None = None,
    cpu: int = 1,
    mem_mb: int = 1024,
    gpus_per_node: int | None = None,
    local: bool = True,
    image: str | None = None,
    mounts: Sequence[str] = (),
) -> AppDef:
    """The torchx app that starts ``pool``'s ranks.

    ``local``: every node runs on this host (a local scheduler), so the
    rendezvous and torch.distributed stay on loopback. So they do for a
    one-node pool on any scheduler. ``image``: the container image of
    container schedulers (default ``"."``: this directory, as ``local_cwd``
    and ``slurm`` use it); ``mounts``: torchx mount strings
    (``type=volume,src=<claim>,dst=<path>``), as ``torchx run --mounts`` takes them.
    """
    from torchx import specs

    from podium.backends.torchrun.rendezvous import BACKEND

    nnodes, nproc = check_pool_shape(pool)
    role_env = dict(env)
    devices = visible_devices(pool)
    if devices is not None:
        role_env["CUDA_VISIBLE_DEVICES"] = devices
    role_env.setdefault("LOGLEVEL", "WARNING")
    if local or nnodes == 1:
        for var, value in _LOOPBACK_ENV.items():
            if var not in role_env and var not in os.environ:
                role_env[var] = value
    if nnodes == 1:
        endpoint = "127.0.0.1:0"  # one agent: its store picks a free port on loopback
    elif local:
        endpoint = f"127.0.0.1:{rdzv_port or 29500}"
    else:
        # The scheduler names rank 0's host in this variable (torchx macro), for
        # bash to expand ("$$": escaped from torchx's template, as escape() does).
        endpoint = f"$${{{specs.macros.rank0_env}:=localhost}}:{rdzv_port or 29500}"
    # Every part but torchx's own macros (app id, replica id) is escaped.
    interpreter = escape(shlex.quote(python or sys.executable))
    cmd = [
        interpreter,
        "-c",
        escape(shlex.quote(LAUNCH)),
        "--rdzv-backend",
        BACKEND,
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        specs.macros.app_id,
        "--rdzv-conf",
        f"rank={specs.macros.replica_id}",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "0",
        "--role",
        ROLE_NAME,
        "--no-python",
        interpreter,
        "-u",
        "-c",
        escape(shlex.quote(BOOT)),
    ]
    try:
        role_mounts = specs.parse_mounts([part for m in mounts for part in m.split(",") if part])
    except (KeyError, ValueError) as exc:
        raise ValueError(
            f"backend_options['mounts'] is {list(mounts)!r}, which torchx cannot parse ({exc}). "
            "Give one string per mount, e.g. 'type=volume,src=my-claim,dst=/shared' or "
            "'type=bind,src=/host/path,dst=/path'."
        ) from None
    gpus = 0
    if pool.use_gpu:
        gpus = nproc if gpus_per_node is None else gpus_per_node
    return specs.AppDef(
        name=name,
        roles=[
            specs.Role(
                name=ROLE_NAME,
                image=image or ".",
                entrypoint="bash",
                args=["-c", " ".join(cmd)],
                num_replicas=nnodes,
                resource=specs.Resource(cpu=cpu, gpu=gpus, memMB=mem_mb),
                env={var: escape(value) for var, value in role_env.items()},
                port_map={"c10d": rdzv_port or 29500},
                max_retries=0,
                mounts=role_mounts,
            )
        ],
    )


_signal_lock = threading.Lock()


def make_runner() -> Runner:
    """A torchx runner; creating it leaves the controller's signal handlers alone."""
    from torchx.runner import get_runner

    return get_runner()


def dryrun(runner: Runner, app: AppDef, scheduler: str, cfg: Mapping[str, Any]) -> Any:
    # torchx's local scheduler installs SIGTERM/SIGINT handlers that raise its own
    # exception when it is first created; podium's controller keeps the user's.
    with _signal_lock:
        saved = _save_signals()
        try:
            return runner.dryrun(app, scheduler, cfg=dict(cfg))
        finally:
            _restore_signals(saved)


def _save_signals() -> dict[int, Any] | None:
    if threading.current_thread() is not threading.main_thread():
        return None
    return {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}


def _restore_signals(saved: dict[int, Any] | None) -> None:
    if saved is None:
        return
    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)
