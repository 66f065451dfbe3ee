"""Real English text that ships with every CPython: the language reference behind `help()`.

`pydoc_data.topics` holds the reference manual's sections as plain text; the demo, tests and benchmarks
use it as the long document whose KV cache is saved and restored, so nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

# Sections in a fixed order, so the same text (and the same token ids) comes back on every run.
SECTIONS = ("with", "compound", "execmodel", "import", "specialnames", "types", "typesseq", "string-methods")


def reference_text(sections: tuple[str, ...] = SECTIONS) -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[s] for s in sections if s in topics)


def reference_tokens(tokenizer: Any, n_tokens: int) -> list[int]:
    """The first `n_tokens` token ids of the reference text (repeated if it is ever too short)."""
    ids = tokenizer(reference_text(), add_special_tokens=False)["input_ids"]
    if not ids:
        raise RuntimeError("the reference text tokenized to nothing")
    while len(ids) < n_tokens:
        ids = ids + ids
    return ids[:n_tokens]
