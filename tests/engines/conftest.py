"""The engine's tests start real processes: Ray and torchrun (through torchx) must be installed."""

import importlib.util

if any(importlib.util.find_spec(m) is None for m in ("ray", "torchx", "zmq")):
    collect_ignore_glob = ["test_*.py"]
