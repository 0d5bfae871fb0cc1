"""Run verl 0.9.1's own CPU tests for ``protocol`` and ``single_controller`` against podium.

The test files run unmodified. A generated ``verl`` package (in a temporary
directory) maps verl's import paths onto podium's public names -- nothing
else: ``verl.protocol`` is ``podium.protocol``, ``verl.single_controller.base``
(and ``.decorator``, ``.worker``, ``.worker_group``) and
``verl.single_controller.ray`` (``RayWorkerGroup`` -> ``WorkerGroup`` on the
Ray backend, ``RayResourcePool`` -> ``ResourcePool``, ``RayClassWithInitArgs``
-> ``ClassWithInitArgs``) are ``podium``. ``verl.utils`` is not part of podium:
its modules import, and using any of their names fails the test.

The verl sdist is fetched once with ``pip download`` and cached in
``.verl_parity/`` (ignored by git). This is a measurement, not part of CI::

    .venv/bin/python scripts/verl_parity.py            # every file
    .venv/bin/python scripts/verl_parity.py -k auto_padding

It prints passed/failed per file and why each failing test failed.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

VERSION = "0.9.1"
ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".verl_parity"
FILES = [
    "tests/test_protocol_on_cpu.py",
    "tests/single_controller/test_auto_padding_on_cpu.py",
    "tests/single_controller/test_decorator_on_cpu.py",
    "tests/single_controller/test_fused_workers_on_cpu.py",
    "tests/single_controller/test_get_set_dispatch_collect_cpu.py",
    "tests/single_controller/test_ray_local_envs_on_cpu.py",
    "tests/single_controller/test_ray_utils_on_cpu.py",
]

# verl module -> (its body). Every module falls back to podium's names for
# anything not spelled here, so a name podium adds later is picked up.
_FALLBACK = """
import podium as _podium
import podium.protocol as _protocol


def __getattr__(name):
    for module in (_protocol, _podium):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"podium has no counterpart of {__name__}.{name}")
"""
_SINGLE_CONTROLLER = """
from podium import *  # noqa: F403
"""
_RAY = """
from podium import *  # noqa: F403
from podium import ClassWithInitArgs as RayClassWithInitArgs  # noqa: F401
from podium import ResourcePool as RayResourcePool  # noqa: F401
from podium import WorkerGroup as RayWorkerGroup  # noqa: F401
"""
_UTILS = """
def __getattr__(name):
    raise AttributeError(
        f"{__name__}.{name}: verl's utils are not part of podium (only verl's import paths of "
        "protocol and single_controller are mapped)"
    )
"""
SHIM = {
    "verl/__init__.py": "from podium.protocol import DataProto  # noqa: F401\n" + _FALLBACK,
    "verl/protocol.py": "from podium.protocol import *  # noqa: F403\n" + _FALLBACK,
    "verl/single_controller/__init__.py": _SINGLE_CONTROLLER + _FALLBACK,
    "verl/single_controller/base/__init__.py": _SINGLE_CONTROLLER + _FALLBACK,
    "verl/single_controller/base/decorator.py": _SINGLE_CONTROLLER + _FALLBACK,
    "verl/single_controller/base/worker.py": _SINGLE_CONTROLLER + _FALLBACK,
    "verl/single_controller/base/worker_group.py": _SINGLE_CONTROLLER + _FALLBACK,
    "verl/single_controller/ray/__init__.py": _RAY + _FALLBACK,
    "verl/single_controller/ray/base.py": _RAY + _FALLBACK,
    "verl/utils/__init__.py": "",
    "verl/utils/tensordict_utils.py": _UTILS,
    "verl/utils/ray_utils.py": _UTILS,
}


def fetch_tests() -> Path:
    """verl's test tree from the cached sdist (downloaded on first use)."""
    src = CACHE / f"verl-{VERSION}"
    if all((src / f).exists() for f in FILES):
        return src
    CACHE.mkdir(exist_ok=True)
    sdist = CACHE / f"verl-{VERSION}.tar.gz"
    if not sdist.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += [f"verl=={VERSION}", "-d", str(CACHE)]
        subprocess.run(cmd, check=True)
    with tarfile.open(sdist) as tar:
        wanted = [m for m in tar.getmembers() if m.name.startswith(f"verl-{VERSION}/tests/")]
        tar.extractall(CACHE, members=wanted, filter="data")
    missing = [f for f in FILES if not (src / f).exists()]
    if missing:
        raise SystemExit(f"the verl {VERSION} sdist has no {missing}")
    return src


def write_shim(where: Path) -> None:
    for rel, body in SHIM.items():
        path = where / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))


def run_file(
    src: Path, rel: str, work: Path, ray_tmp: Path, extra: list[str]
) -> list[tuple[str, str, str]]:
    """``[(test, outcome, reason)]`` for one verl test file, run in its own pytest process."""
    test_dir = work / "verl_tests" / Path(rel).parent.name
    test_dir.mkdir(parents=True, exist_ok=True)
    target = test_dir / Path(rel).name
    target.write_bytes((src / rel).read_bytes())
    report = work / f"{target.stem}.xml"
    env = dict(os.environ)
    # Ray workers import the test module and the shim by name: both on the path.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(work / "shim"), str(test_dir), env.get("PYTHONPATH", "")]
    )
    env["PODIUM_BACKEND"] = "ray"
    # verl's tests call ray.init(num_cpus=...), which joins any Ray cluster already
    # running on this machine (and then refuses num_cpus): give them a Ray of their own.
    env.pop("RAY_ADDRESS", None)
    env["RAY_TMPDIR"] = str(ray_tmp)
    (work / "pytest.ini").write_text("[pytest]\ntimeout = 300\n")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-c",
        str(work / "pytest.ini"),
    ]
    cmd += ["--rootdir", str(work), f"--junitxml={report}", str(target), *extra]
    subprocess.run(cmd, cwd=test_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not report.exists():
        return [(rel, "error", "pytest wrote no report")]
    results = []
    for case in ET.parse(report).iter("testcase"):
        name = case.get("name", "?")
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                lines = (node.get("message") or "").strip().splitlines()
                reason = lines[0][:200] if lines else ""
                if reason == "collection failure":  # the cause is in the text: its "E" lines
                    found = [
                        x[1:].strip() for x in (node.text or "").splitlines() if x.startswith("E ")
                    ]
                    reason = f"collection failure: {found[-1][:200]}" if found else reason
                break
        results.append((name, outcome, reason))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", help="only files whose name contains this")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest")
    args = parser.parse_args()
    src = fetch_tests()
    files = [f for f in FILES if not args.k or args.k in f]
    totals = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    with tempfile.TemporaryDirectory(prefix="verl-parity-") as tmp:
        work = Path(tmp)
        write_shim(work / "shim")
        # Short: Ray's socket paths live under it (a Unix socket path has ~100 characters).
        ray_tmp = Path(tempfile.mkdtemp(prefix="vp-", dir="/tmp"))
        atexit.register(shutil.rmtree, ray_tmp, ignore_errors=True)
        for rel in files:
            results = run_file(src, rel, work, ray_tmp, args.pytest_args)
            counts = {k: sum(1 for _, o, _ in results if o == k) for k in totals}
            for k in totals:
                totals[k] += counts[k]
            print(
                f"{rel}: {counts['passed']} passed, {counts['failed'] + counts['error']} failed"
                + (f", {counts['skipped']} skipped" if counts["skipped"] else ""),
                flush=True,
            )
            for name, outcome, reason in results:
                if outcome in ("failed", "error"):
                    print(f"    FAILED {name}: {reason}", flush=True)
    ran = sum(totals.values())
    print(
        f"total: {totals['passed']} of {ran} passed, {totals['failed'] + totals['error']} failed"
        + (f", {totals['skipped']} skipped" if totals["skipped"] else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
