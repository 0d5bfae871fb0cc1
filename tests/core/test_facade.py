"""The public facade: every exported name resolves, and core imports no backend."""

import subprocess
import sys
import textwrap

import podium


def test_every_name_in_all_resolves() -> None:
    missing = [name for name in podium.__all__ if not hasattr(podium, name)]
    assert missing == []
    assert len(set(podium.__all__)) == len(podium.__all__)


def test_import_podium_with_backends_blocked() -> None:
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("ray", "torchx", "zmq"):
                    raise ImportError(f"{name} is blocked for this test")
                return None

        sys.meta_path.insert(0, Block())
        import podium
        from podium import ClassWithInitArgs, ResourcePool, WorkerGroup, Worker, register, Dispatch

        class W(Worker):
            @register(dispatch_mode=Dispatch.ONE_TO_ALL)
            def rank_of(self):
                return self.rank

        wg = WorkerGroup(ResourcePool([3], use_gpu=False), ClassWithInitArgs(W), backend="inline")
        assert wg.rank_of() == [0, 1, 2]
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "torchx", "zmq"))
        assert not leaked, leaked
        print("isolated-ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "isolated-ok" in out.stdout


def test_missing_backend_dependency_names_the_extra() -> None:
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "ray":
                    raise ModuleNotFoundError(f"No module named {name!r}")
                return None

        sys.meta_path.insert(0, Block())
        from podium import UnknownBackendError, load_backend
        try:
            load_backend("ray")
        except UnknownBackendError as exc:
            print(exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "'ray' is declared but failed to load" in out.stdout
    assert "pip install 'podium[ray]'" in out.stdout
    assert "inline" in out.stdout  # the installed backends are listed
