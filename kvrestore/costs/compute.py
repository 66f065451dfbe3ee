"""What compute costs: a prefill of n tokens after a past (`ChunkCost`) and one decoder layer over N
tokens (`LayerCost`), and their fits to measured samples.

Attention makes a token's cost grow with its position (Cake's "chunk prefill time grows linearly with
chunk index"), so a chunk's cost has a term in its past; a layer run over N tokens at once has one in N^2.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvrestore.costs.fit import fit_nonnegative


class ChunkCost(msgspec.Struct, frozen=True):
    """Seconds to prefill `n` tokens after `past` tokens whose KV is known (one call of the backend):
    ``fixed + n * per_token + n * past * per_token_past + n^2 * per_token2``. The past and the new
    tokens' own attention get separate terms: a whole-prompt prefill runs causal attention far more
    efficiently than a chunk attending to a past does."""

    fixed_s: float
    per_token_s: float
    per_token_past_s: float
    per_token2_s: float = 0.0

    @classmethod
    def per_pair(cls, fixed_s: float, per_token_s: float, per_pair_s: float) -> ChunkCost:
        """``fixed + n * per_token + n * (past + n / 2) * per_pair``: every attended pair, past or causal
        (n^2 / 2 of them), costs alike; what a serving engine's prefill steps pin with few samples."""
        return cls(fixed_s, per_token_s, per_pair_s, per_pair_s / 2)

    def seconds(self, n_tokens: int, past: int = 0) -> float:
        n = n_tokens
        return (
            self.fixed_s + n * self.per_token_s + n * past * self.per_token_past_s + n * n * self.per_token2_s
        )


class LayerCost(msgspec.Struct, frozen=True):
    """Seconds to run one decoder layer over `n` tokens at once (no past)."""

    fixed_s: float
    per_token_s: float
    per_token2_s: float

    def seconds(self, n_tokens: int) -> float:
        return self.fixed_s + n_tokens * self.per_token_s + n_tokens * n_tokens * self.per_token2_s


def fit_chunk_cost(samples: Sequence[Sequence[float]]) -> ChunkCost:
    """Fit [n, past, seconds] samples to `ChunkCost`."""
    feats = [[1.0, n, n * p, n * n] for n, p, _ in samples]
    return ChunkCost(*fit_nonnegative(feats, [s for _, _, s in samples]))


def fit_layer_cost(samples: Sequence[Sequence[float]]) -> LayerCost:
    """Fit [n, seconds per layer] samples to `LayerCost`."""
    feats = [[1.0, n, n * n] for n, _ in samples]
    return LayerCost(*fit_nonnegative(feats, [s for _, s in samples]))
