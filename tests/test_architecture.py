"""The package's structure, checked (docs/architecture.md describes it): a layer imports only itself and the
layers before it, every top-level package is in the list, and objects are composed, not mixed in.

Module length is a review question, not a rule: `python tests/test_architecture.py` lists the modules
over `REVIEW_LINES` lines, for a reviewer to ask whether each holds one job."""

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

#: past this many lines a module is worth a reviewer's question (does it hold one job?); not a failure
REVIEW_LINES = 400

def _modules(package: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


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


def long_modules(package: Path = PACKAGE) -> dict[str, int]:
    """Modules over `REVIEW_LINES` lines, with their lengths: questions for a review."""
    return {
        str(p.relative_to(package.parent)): n
        for p in _modules(package)
        if (n := len(p.read_text().splitlines())) > REVIEW_LINES
    }


def test_long_modules_are_found_for_review(tmp_path):
    fake = tmp_path / "kvrestore"
    fake.mkdir()
    (fake / "short.py").write_text("x = 1\n")
    (fake / "long.py").write_text("x = 1\n" * (REVIEW_LINES + 1))
    assert long_modules(fake) == {"kvrestore/long.py": REVIEW_LINES + 1}


def _base_name(node: ast.expr) -> str:
    """`Name`, `mod.Name` or `Name[T]` as the bare class name."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return ast.unparse(node).rsplit(".", 1)[-1]


#: bases that make a class a record or an interface, whose annotations declare fields, not borrowed state
_DECLARING_BASES = {"ABC", "Protocol", "Struct", "NamedTuple", "TypedDict", "Enum"}


def _declared_not_set(cls: ast.ClassDef) -> list[str]:
    """Attributes `cls` annotates without a value (also under `if TYPE_CHECKING:`) and never sets on
    `self` or `cls` in its own methods: state another class's constructor must provide."""
    body = list(cls.body)
    for node in cls.body:
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            body += node.body
    declared = [
        n.target.id
        for n in body
        if isinstance(n, ast.AnnAssign) and n.value is None and isinstance(n.target, ast.Name)
    ]
    declared += [n.name for n in body if isinstance(n, ast.FunctionDef) and n in body[len(cls.body) :]]
    assigned = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for e in ast.walk(target):
                    if (
                        isinstance(e, ast.Attribute)
                        and isinstance(e.value, ast.Name)
                        and e.value.id in ("self", "cls")
                    ):
                        assigned.add(e.attr)
    return [name for name in declared if name not in assigned]


def _mixins(package: Path = PACKAGE) -> list[str]:
    """Mixin classes in `package`: one named `*Mixin`, or a base of another class that declares
    attributes it never sets (`_declared_not_set`), or a class with two or more bases from the package
    that are not interfaces (ABCs). Records and interfaces are not mixins."""
    classes: dict[str, tuple[str, ast.ClassDef]] = {}
    for path in _modules(package):
        where = str(path.relative_to(package.parent))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (where, node)

    def bases(cls: ast.ClassDef) -> set[str]:
        return {_base_name(b) for b in cls.bases}

    def declaring(cls: ast.ClassDef) -> bool:
        decorated = any("dataclass" in ast.unparse(d) for d in cls.decorator_list)
        return decorated or bool(bases(cls) & _DECLARING_BASES)

    used_as_base = {b for _, cls in classes.values() for b in bases(cls)}
    found = []
    for name, (where, cls) in sorted(classes.items()):
        ours = [b for b in bases(cls) if b in classes and not declaring(classes[b][1])]
        if name.endswith("Mixin"):
            found.append(f"{where}: {name} is named a mixin")
        elif name in used_as_base and not declaring(cls) and (borrowed := _declared_not_set(cls)):
            found.append(f"{where}: {name} is a base that uses state it does not set: {borrowed}")
        elif len(ours) > 1:
            found.append(f"{where}: {name} mixes {sorted(ours)}")
    return found


def test_no_mixins():
    """Objects are composed: a class that needs another's state holds that object (see
    docs/architecture.md)."""
    found = _mixins()
    assert not found, "mixin classes (compose objects instead):\n" + "\n".join(found)


def test_the_mixin_check_can_fail(tmp_path):
    fake = tmp_path / "kvrestore"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "m.py").write_text(
        "from abc import ABC\n"
        "from dataclasses import dataclass\n"
        "class LoggingMixin:\n    pass\n"
        "class Moves:\n    tiers: list\n    def move(self):\n        return self.tiers\n"
        "class Store(Moves):\n    def __init__(self):\n        self.tiers = []\n"
        "class A:\n    pass\n"
        "class B:\n    pass\n"
        "class AB(A, B):\n    pass\n"
        "class Face(ABC):\n    wait: int\n"
        "class Other(ABC):\n    pass\n"
        "class Both(Face, Other):\n    wait = 1\n"
        "@dataclass\nclass Rec:\n    x: int\n"
        "class SubRec(Rec):\n    pass\n"
    )
    found = _mixins(fake)
    assert [f.split(": ")[1].split()[0] for f in found] == ["AB", "LoggingMixin", "Moves"], found
    (fake / "integrations").mkdir()
    (fake / "integrations" / "x.py").write_text("class SideMixin:\n    pass\n")
    assert len(_mixins(fake)) == 4  # no layer is exempt


#: what reading or verifying a stored chunk's bytes takes: a store's reads, and the codec's parsing and
#: checks of a chunk. chunkio is the one place that does it; an integration hands it destinations.
CHUNK_BYTES = {
    "get_range",
    "get_ranges",
    "get_many",
    "read_into",
    "read_into_sync",
    "scatter_into_sync",
    "get_sync",
    "probe_header",
    "read_header",
    "header_length",
    "check_header",
    "check_object",
    "check_section",
    "check_heads",
    "head_ranges",
    "join_heads",
    "decode_heads",
    "verify_sections",
    "decode_chunk",
    "decode_layers",
    "span_sections",
    "layer_span",
    "host_checksum",
    "host_checksum_parts",
    "device_checksums",
    "segment_checksums",
}


def _reads_chunk_bytes(path: Path) -> list[str]:
    """Where `path` reads or verifies chunk bytes itself (`CHUNK_BYTES`, named or imported, or the codec's
    chunk and checksum modules imported)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.ImportFrom):
            if node.module in ("kvrestore.codec.chunk", "kvrestore.codec.checksums"):
                names = [node.module]
            names += [a.name for a in node.names]
        found += [
            f"{path.name}:{node.lineno}: {n}"
            for n in names
            if n in CHUNK_BYTES or n.startswith("kvrestore.codec.c")
        ]
    return found


def test_no_integration_reads_or_verifies_chunk_bytes():
    """Integrations adapt an engine to chunkio's reader (its pages are destinations); they never read a
    store's chunk or check its bytes themselves (docs/architecture.md, the read path)."""
    found = [f for p in _modules(PACKAGE / "integrations") for f in _reads_chunk_bytes(p)]
    assert not found, "chunk bytes read or verified outside chunkio:\n" + "\n".join(found)


def test_the_chunk_bytes_check_can_fail(tmp_path):
    bad = tmp_path / "load.py"
    bad.write_text(
        "from kvrestore.codec.checksums import host_checksum\n"
        "async def f(store, key):\n"
        "    return await store.get_range(key, 0, 10)\n"
        "def g(codec, header, data):\n"
        "    return codec.check_section(header, 0, data)\n"
    )
    assert sorted(f.split(": ")[1] for f in _reads_chunk_bytes(bad)) == [
        "check_section",
        "get_range",
        "host_checksum",
        "kvrestore.codec.checksums",
    ]


def test_the_restorer_is_a_thin_facade():
    """`Restorer` delegates its jobs to the layers below: its class has under 200 lines of code (its
    docstrings, which document the public API, are not counted)."""
    tree = ast.parse((ROOT / "kvrestore" / "restorer.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Restorer"]
    assert cls.end_lineno is not None
    docs = [
        n.body[0]
        for n in ast.walk(cls)
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
        and isinstance(n.body[0].value.value, str)
    ]
    doc_lines = sum((d.end_lineno or d.lineno) - d.lineno + 1 for d in docs)
    assert cls.end_lineno - cls.lineno + 1 - doc_lines < 200


if __name__ == "__main__":
    for name, n in sorted(long_modules().items(), key=lambda kv: -kv[1]):
        print(f"{n:5d}  {name}")
