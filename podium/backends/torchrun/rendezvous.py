"""The rendezvous torchrun's agents use in a podium group, and the agent's entry point.

torchrun's ``c10d`` rendezvous unpickles state that it reads from its store,
and every ``TCPStore`` server torch creates listens on all interfaces
whatever host it is given; the store has no authentication. So anyone who
could reach the port could run code inside the agent. podium's agents use
this rendezvous instead (``--rdzv-backend podium-static``):

- it is torch's static rendezvous (fixed node ranks, ``--rdzv-conf rank=N``;
  the agents then exchange only JSON), so nothing read from the store is
  unpickled;
- node 0 serves the store on a socket it binds itself to the rendezvous
  address only (``TCPStore(master_listen_fd=...)``): ``127.0.0.1`` for a
  local scheduler, the address of node 0's host name on a multi-node one.
  The workers' ``init_process_group`` reuses this store
  (``TORCHELASTIC_USE_AGENT_STORE``) and opens no listener of its own.

The agent runs :func:`main` (see :data:`.launch.LAUNCH`), which registers the
handler and then runs ``torch.distributed.run``: nothing has to be installed
as an entry point. Like the worker module, this file is loaded by its path
and imports nothing of podium (the agent never needs tensordict).
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from typing import Any

__all__ = ["BACKEND", "main"]

BACKEND = "podium-static"
_DEFAULT_TIMEOUT = 600


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _listen(host: str, port: int, nodes: int) -> socket.socket:
    """A TCP socket listening on ``host``'s address only (``port`` 0: any free port)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first, as clients try it
    family, kind, proto, _, addr = infos[0]
    if nodes > 1 and ipaddress.ip_address(addr[0]).is_loopback and not _is_loopback(host):
        # e.g. a host name that /etc/hosts maps to 127.0.1.1: other nodes reach
        # this host by another address, so listen where torch's own store does.
        sys.stderr.write(
            f"podium rendezvous: {host} resolves to {addr[0]} on this node, which other nodes "
            "cannot reach; the store listens on every interface (see docs/trust-model.md)\n"
        )
        addr = ("::" if family == socket.AF_INET6 else "0.0.0.0", port, *addr[2:])
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(1024)
    return sock


def create_handler(params: Any) -> Any:
    """torchrun's rendezvous handler factory for ``--rdzv-backend podium-static``."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class LocalStaticRendezvous(StaticTCPRendezvous):
        """Static rendezvous whose store (on node 0) listens on the rendezvous address only."""

        _listener: socket.socket | None = None

        def next_rendezvous(self) -> Any:
            if self._store is None:
                if self.rank == 0:
                    # Kept open for the agent's life: the store serves on this fd.
                    self._listener = _listen(self.master_addr, self.master_port, self.world_size)
                    self.master_port = int(self._listener.getsockname()[1])
                    self._store = TCPStore(
                        self.master_addr,
                        self.master_port,
                        self.world_size,
                        True,
                        self.timeout,
                        master_listen_fd=self._listener.fileno(),
                    )
                else:
                    self._store = TCPStore(
                        self.master_addr, self.master_port, self.world_size, False, self.timeout
                    )
            store = PrefixStore(self.run_id, self._store)
            info = RendezvousStoreInfo(self.master_addr, self.master_port)
            return RendezvousInfo(store, self.rank, self.world_size, info)

        def get_backend(self) -> str:
            return BACKEND

    try:
        rank = int(params.config["rank"])
    except (KeyError, ValueError):
        raise ValueError(
            f"the {BACKEND} rendezvous needs the node's rank: --rdzv-conf rank=<node rank>"
        ) from None
    host, port = parse_rendezvous_endpoint(params.endpoint.strip(), -1)
    if not host or port < 0:
        raise ValueError(f"the {BACKEND} rendezvous needs --rdzv-endpoint host:port")
    if port == 0 and params.max_nodes > 1:
        raise ValueError(f"the {BACKEND} rendezvous needs a fixed port for more than one node")
    timeout = int(params.config.get("timeout", _DEFAULT_TIMEOUT))
    return LocalStaticRendezvous(host, port, rank, params.max_nodes, params.run_id, timeout)


def main(argv: list[str]) -> None:
    """Run torchrun with ``argv`` (its command line), with this rendezvous registered."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.run import main as torchrun_main

    rendezvous_handler_registry.register(BACKEND, create_handler)
    torchrun_main(argv)
