"""Which of the controller's modules a worker can import by name.

User code reaches a worker by reference (its module is imported there) when
the worker can import that module, and by value (cloudpickle rebuilds it from
the pickle) otherwise. By reference is what keeps a class itself: by value, the
worker gets a copy, so ``isinstance`` against the worker's own import of the
class is False and class-level state is duplicated.

The rule: a worker is an interpreter started with the controller's environment
(``PYTHONPATH`` and what ``worker_env`` sets, the same site-packages and ``.pth``
files -- editable installs included), and *without* the directories that only
the way the controller was started put on its ``sys.path``: the script's
directory or the current directory, and the directories pytest inserts for
test files. To learn that interpreter's ``sys.path`` and its import hooks, one
is started once per ``PYTHONPATH`` value (about 0.1 s), and the module's
top-level package is then looked up on that path, in this process, without
importing anything. The module is importable when that lookup finds it at the
same place as the controller's copy.

Workers on machines that do not share the controller's file system, or Ray
clusters started without the controller's ``PYTHONPATH``, may lack modules this
rule calls importable; ship the code to them (an installed package, Ray's
``runtime_env``) as for any dependency.
"""

from __future__ import annotations

import functools
import importlib.machinery
import json
import os
import subprocess
import sys
import types
from collections.abc import Sequence

__all__ = ["worker_can_import"]

_PROBE = """
import json, sys
def name(f):
    return getattr(f, "__module__", "") + "." + getattr(f, "__qualname__", type(f).__qualname__)
print(json.dumps([sys.path, [name(f) for f in sys.meta_path]]))
"""


@functools.lru_cache(maxsize=16)
def _fresh_interpreter(pythonpath: str | None) -> tuple[tuple[str, ...], frozenset[str]] | None:
    """``sys.path`` (without the current directory) and import-hook names of a fresh interpreter.

    ``None`` when no interpreter could be asked (then nothing counts as importable).
    """
    env = dict(os.environ)
    env.pop("PYTHONSAFEPATH", None)
    if pythonpath is None:
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = pythonpath
    if not sys.executable:
        return None
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        path, finders = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    if path and path[0] == "":  # ``python -c`` puts the current directory first
        path = path[1:]
    return tuple(os.path.realpath(p) for p in path if p), frozenset(finders)


def _finder_name(finder: object) -> str:
    module = getattr(finder, "__module__", "")
    return f"{module}.{getattr(finder, '__qualname__', type(finder).__qualname__)}"


def _import_root(name: str, path: str) -> str | None:
    """The directory from which ``name`` was imported (``path`` minus the dotted name), if it fits."""
    parts = name.split(".")
    where = os.path.realpath(path)
    stem = os.path.basename(where).split(".")[0]
    where = os.path.dirname(where)
    if stem != "__init__":
        if stem != parts[-1]:
            return None
        parts = parts[:-1]
    for part in reversed(parts):
        if os.path.basename(where) != part:
            return None
        where = os.path.dirname(where)
    return where


def _found_at(spec: importlib.machinery.ModuleSpec | None, top: str, root: str) -> bool:
    if spec is None:
        return False
    if spec.submodule_search_locations is not None:  # a package: regular or namespace
        return os.path.join(root, top) in {
            os.path.realpath(p) for p in spec.submodule_search_locations
        }
    return bool(spec.origin) and os.path.dirname(os.path.realpath(str(spec.origin))) == root


@functools.lru_cache(maxsize=1024)
def _can_import(name: str, path: str, pythonpath: str | None) -> bool:
    root = _import_root(name, path)
    fresh = _fresh_interpreter(pythonpath)
    if root is None or fresh is None:
        return False
    search: Sequence[str] = fresh[0]
    top = name.partition(".")[0]
    # The worker's import system: its hooks in this process's order, the path
    # finder over the worker's sys.path. Hooks only this process has (pytest's
    # assertion rewriter, anything added at run time) are not the worker's.
    for finder in sys.meta_path:
        if _finder_name(finder) not in fresh[1]:
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            if finder is importlib.machinery.PathFinder:
                spec = importlib.machinery.PathFinder.find_spec(top, list(search))
            else:
                spec = find_spec(top, None)
        except (ImportError, ValueError):
            continue
        if spec is not None:
            return _found_at(spec, top, root)
    return False


def worker_can_import(module: types.ModuleType, pythonpath: str | None) -> bool:
    """Whether a worker started with ``PYTHONPATH=pythonpath`` imports ``module`` from the same file."""
    path = getattr(module, "__file__", None)
    if not path or module.__name__ == "__main__":
        return False
    return _can_import(module.__name__, path, pythonpath)
