"""The README and every tutorial under docs/ run: a tutorial's python blocks in order in one namespace
per page, each README block on its own (a reader pastes one)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


#: tutorials that need another environment run in their own tier (tutorial-vllm.md: `make test-vllm`)
OTHER_TIERS = {"tutorial-vllm.md"}
#: pages that describe, with nothing to run
NOT_TUTORIALS = {"architecture.md", "benchmarks.md"}


def run_blocks(path: Path) -> None:
    blocks = python_blocks(path)
    assert blocks, f"{path.name} has no python blocks"
    namespace: dict = {"__name__": f"docs.{path.name}"}
    for i, block in enumerate(blocks):
        code = compile(block, f"{path.name}[block {i}]", "exec")
        exec(code, namespace)


@pytest.mark.model
@pytest.mark.parametrize(
    "doc", sorted(p.name for p in DOCS.glob("*.md") if p.name not in OTHER_TIERS | NOT_TUTORIALS)
)
def test_doc_runs(doc, smollm2):
    run_blocks(DOCS / doc)


def _readme_blocks() -> list:
    """Each README block alone, as a reader pastes it: the ones that load the real model in the slow
    tier (as the doc pages), the others in the fast one."""
    marks = lambda block: [pytest.mark.model] if "from_smollm2" in block else []  # noqa: E731
    return [
        pytest.param(block, id=f"block{i}", marks=marks(block))
        for i, block in enumerate(python_blocks(ROOT / "README.md"))
    ]


@pytest.mark.parametrize("block", _readme_blocks())
def test_each_readme_block_runs_on_its_own(block):
    exec(compile(block, "README.md", "exec"), {"__name__": "readme"})


def test_readme_is_read_in_two_minutes():
    """At most 150 lines; the benchmark tables live in docs/benchmarks.md, the history in CHANGELOG.md."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_the_glossary_defines_the_words_the_demo_prints():
    """`kvrestore demo` points at the glossary for its words and for those of `plan.explain()`."""
    from kvrestore.tools.demo import GLOSSARY

    page, anchor = GLOSSARY.split("#")
    text = (ROOT / page).read_text()
    assert f"\n## {anchor.capitalize()}\n" in text
    words = {
        word.strip()
        for line in text.split(f"## {anchor.capitalize()}")[1].splitlines()
        if line.startswith("| ")
        for word in line.split("|")[1].split(",")
    }
    assert {"TTFT", "balance point", "T* bound", "Tc", "Tio", "L_delta"} <= words
