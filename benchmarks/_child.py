"""One implementation, one repeat, in a fresh process: ``python -m benchmarks._child IMPL SIZES``.

Prints ``RESULT {json}``: flat metrics (see :mod:`benchmarks._common`); a key
``other:metric`` belongs to the implementation ``other`` measured in the same process.
verl's venv runs this module too, so nothing here imports podium before it is asked for.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # "from nothing": before any framework is imported

import json  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._common import Sizes  # noqa: E402


def measure(impl: str, sizes: Sizes) -> dict[str, Any]:
    if impl.startswith("podium-"):
        from benchmarks import _podium

        return _podium.run(impl.removeprefix("podium-"), sizes, T0)
    if impl == "verl":
        from benchmarks import _verl

        return _verl.run(sizes, T0)
    if impl == "raw-ray":
        from benchmarks import _raw

        return _raw.run(sizes, T0)
    if impl == "machine":
        from benchmarks import _limits

        return _limits.run(sizes, T0)
    raise SystemExit(f"unknown implementation {impl!r}")


def main() -> None:
    impl, raw = sys.argv[1], json.loads(sys.argv[2])
    sizes = Sizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})  # type: ignore[arg-type]
    print("RESULT " + json.dumps(measure(impl, sizes)), flush=True)


if __name__ == "__main__":
    main()
