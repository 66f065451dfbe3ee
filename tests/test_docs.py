"""Every tutorial under docs/ runs: its python blocks are executed in order in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


#: tutorials that need another environment run in their own tier (tutorial-vllm.md: `make test-vllm`)
OTHER_TIERS = {"tutorial-vllm.md"}
#: pages that describe, with nothing to run
NOT_TUTORIALS = {"architecture.md"}


@pytest.mark.model
@pytest.mark.parametrize("doc", sorted(p.name for p in DOCS.glob("*.md") if p.name not in OTHER_TIERS | NOT_TUTORIALS))
def test_doc_runs(doc, smollm2):
    blocks = python_blocks(DOCS / doc)
    assert blocks, f"{doc} has no python blocks"
    namespace: dict = {"__name__": f"docs.{doc}"}
    for i, block in enumerate(blocks):
        code = compile(block, f"{doc}[block {i}]", "exec")
        exec(code, namespace)
