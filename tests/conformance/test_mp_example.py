"""The example backend of docs/writing-a-backend.md passes ``podium conformance``.

The example is not installed: its entry point is declared here, in a
``.dist-info`` directory on ``PYTHONPATH``, which is what ``pip install`` of
the example would leave behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "backends" / "mp_backend"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_mp_example_backend_passes_the_conformance_suite(tmp_path: Path) -> None:
    dist = tmp_path / "podium_mp_backend-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: podium-mp-backend\nVersion: 0.1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[podium.backends]\nmp = podium_mp:MultiprocessingBackend\n"
    )
    path = [str(tmp_path), str(EXAMPLE), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    listed = subprocess.run(
        [sys.executable, "-m", "podium.cli", "backends"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "podium_mp.MultiprocessingBackend" in listed.stdout, listed.stdout + listed.stderr
    run = subprocess.run(
        [sys.executable, "-m", "podium.cli", "conformance", "mp"],
        env=env,
        capture_output=True,
        text=True,
        timeout=850,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
