"""The launcher tests start real processes: they need Ray and torchrun (torchx + pyzmq).

Without them only the one-process tests (inline backend) are collected.
"""

import importlib.util

if any(importlib.util.find_spec(m) is None for m in ("ray", "torchx", "zmq")):
    collect_ignore_glob = ["test_grpo_launchers.py", "test_fsdp_tp.py"]
