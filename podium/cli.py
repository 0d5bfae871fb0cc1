"""The ``podium`` command: ``podium backends`` and ``podium conformance NAME``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from podium.core.backend import (
    ENTRY_POINT_GROUP,
    KNOWN_EXTRAS,
    backend_class,
    load_plugins,
)
from podium.errors import UnknownBackendError


def _dist_version(plugin: type) -> str:
    try:
        return str(plugin.version())  # type: ignore[attr-defined]
    except Exception as exc:  # a plugin's version hook must not break the listing
        return f"? ({exc})"


def options_markdown(plugin: type) -> str:
    """The Markdown table of a backend's ``backend_options``, built from its declarations."""
    rows = ["| option | type | default | meaning |", "| --- | --- | --- | --- |"]
    for opt in getattr(plugin, "options", ()):
        types = opt.type if isinstance(opt.type, tuple) else (opt.type,)
        kind = " or ".join(t.__name__ for t in types)
        rows.append(f"| `{opt.name}` | {kind} | `{opt.default!r}` | {opt.help} |")
    if len(rows) == 2:
        return "(no options)"
    return "\n".join(rows)


def cmd_backends(args: argparse.Namespace) -> int:
    loaded, failed = load_plugins()
    if getattr(args, "options_markdown", False):
        for name, plugin in sorted(loaded.items()):
            print(f"### `{name}` options\n\n{options_markdown(plugin)}\n")
        return 0
    rows = []
    for name, plugin in sorted(loaded.items()):
        caps = plugin.capabilities.as_dict()
        on = ", ".join(k for k, v in caps.items() if v) or "-"
        rows.append((name, _dist_version(plugin), f"{plugin.__module__}.{plugin.__qualname__}", on))
    default = os.environ.get("PODIUM_BACKEND") or "ray"
    header = ("backend", "version", "class", "capabilities")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    print(f"{header[0]:<{widths[0]}}  {header[1]:<{widths[1]}}  {header[2]:<{widths[2]}}  {header[3]}")
    for row in rows:
        mark = " (default)" if row[0] == default else ""
        print(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}{mark}")
    if not rows:
        print(f"(no backends installed in entry-point group {ENTRY_POINT_GROUP!r})")
    for name, plugin in sorted(loaded.items()):
        try:
            lines = plugin.describe_environment()
        except Exception as exc:  # a plugin's hook must not break the listing
            lines = [f"(could not describe its environment: {type(exc).__name__}: {exc})"]
        if lines:
            print(f"\n{name}:")
            for line in lines:
                print(f"  {line}")
    if failed:
        print("\nplugins that failed to load:")
        for name, reason in sorted(failed.items()):
            missing = reason.startswith(("ModuleNotFoundError", "ImportError"))
            hint = f"  -> pip install '{KNOWN_EXTRAS[name]}'" if missing and name in KNOWN_EXTRAS else ""
            print(f"  {name}: {reason}{hint}")
    return 0


def cmd_conformance(args: argparse.Namespace) -> int:
    try:
        backend_class(args.name)
    except UnknownBackendError as exc:
        print(f"podium: {exc}", file=sys.stderr)
        return 2
    import importlib.util
    import subprocess

    spec = importlib.util.find_spec("podium.testing.conformance")
    if spec is None or not spec.submodule_search_locations:
        print("podium: the conformance suite is not installed with this podium", file=sys.stderr)
        return 2
    pytest_args = [
        sys.executable,
        "-m",
        "pytest",
        list(spec.submodule_search_locations)[0],
        "--podium-backend",
        args.name,
        "-o",
        "python_files=test_conformance.py",
        "-rs",
        "-q" if not args.verbose else "-v",
    ]
    if args.options:
        json.loads(args.options)  # fail here, with the JSON error, not deep in pytest
        pytest_args += ["--podium-backend-options", args.options]
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    # A fresh interpreter: pytest must import podium itself to rewrite the suite's asserts.
    return subprocess.run(pytest_args, check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="podium", description="podium: single-controller distributed PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p_backends = sub.add_parser(
        "backends",
        help="list installed backends, their capabilities and what each can use here "
        "(torchrun: the torchx schedulers)",
    )
    p_backends.add_argument(
        "--options-markdown",
        action="store_true",
        help="print each backend's backend_options as Markdown tables (docs/backends.md is made so)",
    )
    p_backends.set_defaults(func=cmd_backends)
    p_conf = sub.add_parser("conformance", help="run the conformance suite against a backend")
    p_conf.add_argument("name", help="backend name, as listed by `podium backends`")
    p_conf.add_argument("--options", help="backend_options as a JSON object", default=None)
    p_conf.add_argument("-k", dest="keyword", default=None, help="only tests matching this pytest expression")
    p_conf.add_argument("-v", "--verbose", action="store_true")
    p_conf.set_defaults(func=cmd_conformance)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
