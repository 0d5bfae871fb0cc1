"""Importable user code crosses to workers by reference; the rest by value.

A worker here is a fresh interpreter started with the controller's environment,
as every backend starts its workers.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import uuid
from pathlib import Path
from types import ModuleType

import pytest

import podium.core.worker
from podium.core.importability import worker_can_import
from podium.core.serialization import dumps, ensure_importable_by_value

SOURCE = """
class Token:
    registry = []

    def __init__(self, value):
        self.value = value
"""

# Unpickles what the controller sent, then imports the module itself, as a worker would.
CHECK = """
import importlib, pickle, sys
token = pickle.loads(sys.stdin.buffer.read())
module = importlib.import_module(sys.argv[1])
print(isinstance(token, module.Token), type(token).registry is module.Token.registry, token.value)
"""


def _package(root: Path) -> str:
    name = f"podium_test_pkg_{uuid.uuid4().hex[:8]}"
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    (root / name / "kinds.py").write_text(SOURCE)
    return f"{name}.kinds"


def _in_a_worker(module: ModuleType, obj: object, pythonpath: str) -> str:
    header, buffers = dumps(obj, out_of_band=False)
    env = dict(os.environ, PYTHONPATH=pythonpath)
    out = subprocess.run(
        [sys.executable, "-c", CHECK, module.__name__],
        input=header,
        env=env,
        capture_output=True,
        timeout=120,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode().strip()


def test_a_package_on_pythonpath_travels_by_reference_and_stays_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _package(tmp_path)
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", pythonpath)
    monkeypatch.syspath_prepend(str(tmp_path))
    kinds = importlib.import_module(name)
    assert worker_can_import(kinds, pythonpath)
    ensure_importable_by_value(kinds.Token)
    assert _in_a_worker(kinds, kinds.Token(7), pythonpath) == "True True 7"


def test_worker_env_pythonpath_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _package(tmp_path)
    # Importable here, not on the controller's PYTHONPATH.
    monkeypatch.syspath_prepend(str(tmp_path))
    kinds = importlib.import_module(name)
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    assert not worker_can_import(kinds, os.environ.get("PYTHONPATH"))
    ensure_importable_by_value(kinds.Token, {"PYTHONPATH": pythonpath})
    assert _in_a_worker(kinds, kinds.Token(1), pythonpath) == "True True 1"


def test_a_module_only_on_the_controllers_sys_path_travels_by_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # as pytest or a script's directory would
    kinds = importlib.import_module(name)
    ensure_importable_by_value(kinds.Token)
    # The worker gets the module's directory only to import it for the comparison;
    # the token itself arrived by value, so it is a copy of the class.
    assert _in_a_worker(kinds, kinds.Token(2), str(tmp_path)) == "False False 2"


def test_test_modules_main_and_installed_code() -> None:
    this = sys.modules[__name__]  # a test file pytest put on sys.path itself
    assert not worker_can_import(this, os.environ.get("PYTHONPATH"))
    assert not worker_can_import(sys.modules["__main__"], os.environ.get("PYTHONPATH"))
    assert worker_can_import(podium.core.worker, os.environ.get("PYTHONPATH"))
    assert worker_can_import(pytest, None)
