"""Backend discovery through the ``podium.backends`` entry-point group."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import podium
from podium import (
    ClassWithInitArgs,
    ResourcePool,
    UnknownBackendError,
    Worker,
    WorkerGroup,
    available_backends,
    load_backend,
)
from podium.backends.inline import InlineBackend
from podium.core.backend import backend_class
from podium.errors import ResourceUnavailableError


def test_inline_is_installed_and_listed() -> None:
    backends = available_backends()
    assert "inline" in backends
    assert backends["inline"].process_group is False


def test_unknown_backend_names_installed_ones_and_suggests() -> None:
    with pytest.raises(UnknownBackendError) as info:
        load_backend("inlin")
    err = info.value
    assert err.suggestion == "inline"
    assert "inline" in err.installed
    assert "Did you mean 'inline'?" in str(err)


def test_podium_backend_environment_variable_selects_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PODIUM_BACKEND", "inline")
    assert isinstance(load_backend(), InlineBackend)
    monkeypatch.setenv("PODIUM_BACKEND", "nope")
    with pytest.raises(UnknownBackendError, match="'nope'"):
        load_backend()


def test_backend_options_are_checked() -> None:
    with pytest.raises(ValueError, match="does not accept option"):
        load_backend("inline", adress="x")


def test_unknown_backend_error_pickles() -> None:
    import pickle

    err = UnknownBackendError("rya", ["inline"], failed={"x": "boom"}, suggestion="ray", extra="podium[ray]")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is UnknownBackendError and back.failed == {"x": "boom"} and str(back) == str(err)


THIRD_PARTY = '''
from podium.backends.inline import InlineBackend, InlineGroup
from podium.core.backend import Capabilities

class EchoBackend(InlineBackend):
    """A third-party backend: an inline variant declared by another package."""
    name = "echo"
    capabilities = Capabilities(fractional_colocation=True)

    def _start_group(self, spec):
        self.started = getattr(self, "started", 0) + 1
        return InlineGroup(spec)
'''


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site directory holding a third-party package with two podium.backends entry points."""
    root = tmp_path_factory.mktemp("site")
    (root / "echo_backend.py").write_text(THIRD_PARTY)
    dist = root / "echo_backend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-backend\nVersion: 1.0\n")
    (dist / "top_level.txt").write_text("echo_backend\n")
    (dist / "entry_points.txt").write_text(
        "[podium.backends]\necho = echo_backend:EchoBackend\nbroken = no_such_module_here:Backend\n"
    )
    return root


def _run(code: str, plugin_dir: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(plugin_dir))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120)


def test_third_party_backend_plugs_in_without_changing_podium(plugin_dir: Path) -> None:
    out = _run(
        """
        from podium import ClassWithInitArgs, Dispatch, ResourcePool, Worker, WorkerGroup, available_backends, register

        class W(Worker):
            @register(dispatch_mode=Dispatch.ONE_TO_ALL)
            def rank_of(self):
                return self.rank

        assert "echo" in available_backends()
        wg = WorkerGroup(ResourcePool([2], use_gpu=False), ClassWithInitArgs(W), backend="echo")
        print(wg.backend, wg.rank_of(), wg._backend.started)
        """,
        plugin_dir,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "echo [0, 1] 1"


def test_broken_plugin_is_reported_not_fatal(plugin_dir: Path) -> None:
    out = _run(
        """
        from podium import available_backends, load_backend, UnknownBackendError
        info = available_backends(include_failed=True)
        print("failed:", sorted(info["__failed__"]))
        try:
            load_backend("broken")
        except UnknownBackendError as exc:
            print("error:", exc)
        """,
        plugin_dir,
    )
    assert out.returncode == 0, out.stderr
    assert "'broken'" in out.stdout.splitlines()[0]
    assert "no_such_module_here" in out.stdout and "failed to load" in out.stdout


def test_cli_backends_lists_inline_and_failed_plugins(plugin_dir: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(plugin_dir))
    out = subprocess.run(
        [sys.executable, "-m", "podium.cli", "backends"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["backend", "version", "class"]
    inline = next(line for line in lines if line.startswith("inline"))
    assert podium.__version__ in inline and "fractional_colocation" in inline
    echo = next(line for line in lines if line.startswith("echo"))
    assert echo.split()[1] == "1.0"  # the third-party distribution's own version
    assert "plugins that failed to load" in out.stdout and "broken" in out.stdout


def test_cli_conformance_runs_the_suite_and_summarizes() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "podium.cli", "conformance", "inline", "-k", "dispatch or dead_worker"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert " passed" in out.stdout and "skipped" in out.stdout
    assert "does not declare capability 'detects_dead_workers'" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "podium.cli", "conformance", "inlnie"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "Did you mean 'inline'" in bad.stderr


def test_backend_class_loads_only_the_selected_plugin(plugin_dir: Path) -> None:
    # A broken sibling plugin must not stop a working backend from loading.
    out = _run(
        """
        import sys
        from podium.core.backend import backend_class
        print(backend_class("echo").__name__, "no_such_module_here" in sys.modules)
        """,
        plugin_dir,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "EchoBackend False"
    assert backend_class("inline") is InlineBackend


class _CheckedInline(InlineBackend):
    """The inline backend with a check that refuses every pool, counting starts."""

    started = 0

    def check_resources(self, pools):  # type: ignore[no-untyped-def]
        raise ResourceUnavailableError("this cluster holds no pool", demand={}, supply={})

    def _start_group(self, spec):  # type: ignore[no-untyped-def]
        self.started += 1
        return super()._start_group(spec)


def test_a_group_the_backend_refuses_is_never_started() -> None:
    backend = _CheckedInline()
    with pytest.raises(ResourceUnavailableError, match="holds no pool"):
        WorkerGroup(ResourcePool([1], use_gpu=False), ClassWithInitArgs(Worker), backend=backend)
    assert backend.started == 0


def test_podium_backend_options_environment_variable_configures_that_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torchx")
    monkeypatch.setenv("PODIUM_BACKEND", "torchrun")
    monkeypatch.setenv(
        "PODIUM_BACKEND_OPTIONS",
        '{"scheduler": "slurm", "scheduler_cfg": {"partition": "debug"}, "tune_malloc": false}',
    )
    # By default and by name (a trainer's --backend flag defaults to $PODIUM_BACKEND).
    for backend in (load_backend(), load_backend("torchrun")):
        assert backend.config["scheduler"] == "slurm"
        assert backend.config["scheduler_cfg"] == {"partition": "debug"}
    # Options in code override the environment's, one by one.
    mixed = load_backend("torchrun", scheduler="local_cwd")
    assert mixed.config["scheduler"] == "local_cwd" and mixed.config["tune_malloc"] is False
    # They belong to the backend $PODIUM_BACKEND names, not to another one loaded by name.
    assert isinstance(load_backend("inline"), InlineBackend)


def test_an_unknown_option_in_the_environment_is_the_did_you_mean_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torchx")
    with pytest.raises(ValueError, match="did you mean 'scheduler'") as in_code:
        load_backend("torchrun", schedulr="slurm")
    monkeypatch.setenv("PODIUM_BACKEND", "torchrun")
    monkeypatch.setenv("PODIUM_BACKEND_OPTIONS", '{"schedulr": "slurm"}')
    with pytest.raises(ValueError) as info:
        WorkerGroup(ResourcePool([1], use_gpu=False), ClassWithInitArgs(Worker))
    assert str(info.value) == f"$PODIUM_BACKEND_OPTIONS: {in_code.value}"
    monkeypatch.setenv("PODIUM_BACKEND_OPTIONS", "{scheduler: slurm}")
    with pytest.raises(ValueError, match=r"PODIUM_BACKEND_OPTIONS is not valid JSON.*e\.g\."):
        load_backend()
    monkeypatch.setenv("PODIUM_BACKEND_OPTIONS", '["slurm"]')
    with pytest.raises(ValueError, match="must be a JSON object"):
        load_backend()


def _scheduler_rows(stdout: str) -> dict[str, str]:
    section = stdout.split("\ntorchrun:\n", 1)[1]
    return {line.split()[0]: line for line in section.splitlines()[1:] if line.strip()}


def test_cli_backends_says_which_torchx_schedulers_are_usable_here() -> None:
    pytest.importorskip("torchx")
    root = str(Path(__file__).resolve().parents[2])
    # No Slurm commands on this PATH, whatever the host has.
    env = dict(os.environ, PYTHONPATH=root, PATH=os.path.dirname(sys.executable))
    out = subprocess.run(
        [sys.executable, "-m", "podium.cli", "backends"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = _scheduler_rows(out.stdout)
    assert rows["local_cwd"].split()[1] == "usable"
    assert "not usable" in rows["slurm"] and "sbatch" in rows["slurm"]
    assert "kubernetes" in rows
