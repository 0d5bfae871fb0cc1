"""The core's modules form layers; a module imports only from layers below its own.

Every import counts -- at module level, inside functions, under
``TYPE_CHECKING`` -- because a lazy import upward is still a cycle in the
design. A new core module must be given its layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import podium

ROOT = Path(podium.__file__).parent

# Lowest first. A module may import modules of lower layers only.
LAYERS: list[set[str]] = [
    {"podium.errors"},
    {
        "podium.core._batch_utils",
        "podium.core.importability",
        "podium.core.modes",
        "podium.core.protocol_config",
    },
    {"podium.core.protocol", "podium.core.serialization", "podium.core.resource"},
    {"podium.core.dataplane", "podium.core.protocol_ops"},
    {"podium.core.futures"},
    {"podium.core.batching"},
    {"podium.core.dispatch"},
    {"podium.core.decorator"},
    {"podium.core.worker"},
    {"podium.core.host"},
    {"podium.core.backend"},
    {"podium.core.batchref"},
    {"podium.core.worker_group"},
    {"podium.core.resource_manager"},
]
LAYER = {module: i for i, layer in enumerate(LAYERS) for module in layer}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def podium_imports(path: Path) -> set[str]:
    """Every podium module ``path`` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("podium")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("podium"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(
                    sub
                    if (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                    else node.module
                )
    return found


def core_modules() -> list[Path]:
    return [p for p in sorted((ROOT / "core").glob("*.py")) if p.name != "__init__.py"] + [
        ROOT / "errors.py"
    ]


def test_every_core_module_has_a_layer() -> None:
    missing = sorted(module_name(p) for p in core_modules() if module_name(p) not in LAYER)
    assert missing == [], f"give these modules a layer in {__file__}: {missing}"


def test_core_modules_import_only_downward() -> None:
    upward = []
    for path in core_modules():
        source = module_name(path)
        for target in sorted(podium_imports(path)):
            if target == "podium.core":
                continue
            if target not in LAYER:
                upward.append(f"{source} imports {target}, outside the core")
            elif LAYER[target] >= LAYER[source]:
                upward.append(
                    f"{source} (layer {LAYER[source]}) imports {target} (layer {LAYER[target]})"
                )
    assert upward == []


def test_the_checker_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    text = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from podium.core.worker_group import WorkerGroup\n"
    text += "def f():\n    from podium.core import dispatch\n    import podium.backends.ray\n"
    fake = tmp_path / "fake.py"
    fake.write_text(text)
    assert podium_imports(fake) >= {
        "podium.core.worker_group",
        "podium.core.dispatch",
        "podium.backends.ray",
    }
