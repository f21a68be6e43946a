"""The import graph flows one way (DESIGN.md): entrypoints -> engine and worker -> model ->
audio and config. A layer that imports one above it fails here, with the offending line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "asrserve"

# What each layer may import from asrserve (besides itself).
ALLOWED = {
    "model": {"config", "errors", "audio"},
    "audio": {"config", "errors"},
    "engine": {"config", "errors", "audio", "model", "worker"},
    "worker": {"config", "errors", "audio", "model", "engine"},
}


def _asrserve_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import of an asrserve module in `path`, those under
    `if TYPE_CHECKING:` included: a type-only edge is still an edge of the design."""
    imports = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        imports += [(node.lineno, name) for name in names if name.split(".")[0] == "asrserve"]
    return imports


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_what_is_below_it(layer):
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files, f"asrserve/{layer} has no modules"
    wrong = []
    for path in files:
        for line, module in _asrserve_imports(path):
            parts = module.split(".")
            target = parts[1] if len(parts) > 1 else ""
            if target != layer and target not in ALLOWED[layer]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_no_module_is_a_manual():
    """Small modules with one job each: none past ~350 lines."""
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 350}
    assert not long, long
