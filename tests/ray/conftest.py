"""The Ray backend's tests need Ray (``pip install 'podium[ray]'``); without it they are not collected."""

import importlib.util

if importlib.util.find_spec("ray") is None:
    collect_ignore_glob = ["test_*.py"]
