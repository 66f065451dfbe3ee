"""The package's layering, checked (docs/architecture.md describes it): a layer imports only itself and the
layers before it, every top-level package is in the list, and modules stay small."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvrestore"

#: The layers, low to high: the top-level packages of kvrestore/ (and restorer.py, a module). A layer may
#: import itself and any layer before it, never one after it. docs/architecture.md mirrors this order.
#: `restore` (a package between planning and the Restorer facade) is listed before it exists.
LAYERS = (
    "core",
    "codec",
    "stores",
    "chunkio",
    "backends",
    "policies",
    "costs",
    "runtime",
    "sim",
    "planning",
    "blend",
    "restore",
    "restorer",
    "distributed",
    "integrations",
    "tools",
)

#: top-level modules that may import anything: the public namespace and `python -m kvrestore`
ENTRY_POINTS = ("__init__", "__main__")

MAX_LINES = 400


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _layer_of(path: Path, package: Path = PACKAGE) -> str:
    """The layer a file of kvrestore/ belongs to: its top-level package, or its own name at the top."""
    rel = path.relative_to(package)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_layers(path: Path) -> list[tuple[int, str, str]]:
    """(line, the import as written, the layer it reaches) for every import of kvrestore in `path`, at
    module level or inside functions (and under TYPE_CHECKING: a type is a dependency too). Importing a
    name from `kvrestore` itself that is no layer reaches the whole package: the layer "kvrestore"."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "kvrestore":
                    found.append(
                        (node.lineno, f"import {alias.name}", parts[1] if len(parts) > 1 else "kvrestore")
                    )
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative imports are not used in kvrestore/: imports say where they go
                found.append(
                    (node.lineno, f"from {'.' * node.level}{node.module or ''} import ...", "relative")
                )
                continue
            parts = (node.module or "").split(".")
            if parts[0] != "kvrestore":
                continue
            if len(parts) > 1:
                found.append((node.lineno, f"from {node.module} import ...", parts[1]))
            else:
                for alias in node.names:
                    layer = alias.name if alias.name in LAYERS else "kvrestore"
                    found.append((node.lineno, f"from kvrestore import {alias.name}", layer))
    return found


def _violations(path: Path, package: Path = PACKAGE) -> list[str]:
    layer = _layer_of(path, package)
    if layer in ENTRY_POINTS:
        return []
    rank = LAYERS.index(layer)
    where = path.relative_to(package.parent)
    out = []
    for line, text, target in _imported_layers(path):
        if target == "relative":
            out.append(f"{where}:{line}: `{text}` is a relative import (write kvrestore.<layer>...)")
        elif target == "kvrestore":
            out.append(f"{where}:{line}: `{text}` imports the whole package from inside layer {layer}/")
        elif target not in LAYERS:
            out.append(f"{where}:{line}: `{text}` reaches {target}, which is not a layer")
        elif LAYERS.index(target) > rank:
            out.append(f"{where}:{line}: `{text}`: layer {layer} imports {target}, a later layer")
    return out


def test_every_top_level_package_is_a_layer():
    """A new top-level package or module must take its place in LAYERS (and docs/architecture.md)."""
    tops = {_layer_of(p) for p in _modules()} - set(ENTRY_POINTS)
    tops |= {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    unknown = sorted(tops - set(LAYERS))
    assert not unknown, f"not in tests/test_architecture.py LAYERS (nor docs/architecture.md): {unknown}"


def test_layers_import_only_themselves_and_earlier_layers():
    problems = [v for path in _modules() for v in _violations(path)]
    assert not problems, "imports against the layering (docs/architecture.md):\n" + "\n".join(problems)


def test_the_checker_sees_every_kind_of_import(tmp_path):
    """The rule can fail: an upward import at module level, in a function, `from kvrestore import <layer>`,
    the whole package, and a relative import are each reported."""
    fake = tmp_path / "kvrestore"
    (fake / "core").mkdir(parents=True)
    bad = fake / "core" / "bad.py"
    bad.write_text(
        "from kvrestore.runtime.engine import Engine\n"
        "import kvrestore.tools.cli\n"
        "def f():\n"
        "    from kvrestore import restorer\n"
        "    from kvrestore import Restorer\n"
        "    from . import spec\n"
        "from kvrestore.core.spec import ModelSpec\n"
        "import torch\n"
    )
    problems = _violations(bad, fake)
    assert [int(v.split(":")[1]) for v in problems] == [1, 2, 4, 5, 6], problems
    assert "layer core imports runtime, a later layer" in problems[0]
    assert _violations(fake / "core" / "bad.py", fake) == problems
    top = fake / "restorer.py"
    top.write_text("from kvrestore.tools.cli import main\nfrom kvrestore.blend import Blend\n")
    assert [int(v.split(":")[1]) for v in _violations(top, fake)] == [1]


def test_the_doc_mirrors_the_layers():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert " → ".join(LAYERS) in doc, "docs/architecture.md must list the layers in LAYERS' order"


def test_no_module_is_longer_than_the_limit():
    long = {
        str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_restorer_is_a_thin_facade():
    """`Restorer` delegates its jobs to the layers below: its class stays under 200 lines."""
    tree = ast.parse((ROOT / "kvrestore" / "restorer.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Restorer"]
    assert cls.end_lineno is not None
    assert cls.end_lineno - cls.lineno + 1 < 200
