"""podium's benchmarks: ``python -m benchmarks [--quick] [--only NAME ...] [--out DIR]``.

Every measure for every implementation (podium on each backend, verl 0.9.1's
``RayWorkerGroup``, raw Ray actors, the machine's own limits) in one interleaved
schedule; see :mod:`benchmarks.harness` and ``python -m benchmarks --help``.
Nothing here imports podium at module level: verl's venv runs the same package.
"""
