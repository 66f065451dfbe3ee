"""A backend restricted to one pipeline stage's layers."""

from __future__ import annotations

from typing import Any

import torch

from kvrestore.core.errors import InvalidInputError


class StageBackend:
    """Layers [start, end) of an `HFBackend`: the compute of one pipeline stage.

    Its KV lives in a stage shard [end - start, 2, H, N, D] (the stage's rows of a full cache).
    `forward_into` takes the hidden state entering layer `start` (the token embedding for stage 0, a boundary
    activation or the previous stage's output otherwise) and returns the one leaving layer `end - 1`.
    """

    def __init__(self, backend: Any, start: int, end: int) -> None:
        n = backend.spec.num_layers
        if not 0 <= start < end <= n:
            raise InvalidInputError(f"layers [{start}, {end}) are not a stage of a {n}-layer model")
        self.backend, self.start, self.end = backend, start, end
        self.spec = backend.spec
        self.device = backend.device

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    @property
    def hidden_size(self) -> int:
        return int(self.backend.config.hidden_size)

    def empty_shard(self, n_tokens: int) -> torch.Tensor:
        spec = self.spec
        shape = (self.n_layers, 2, spec.num_kv_heads, n_tokens, spec.head_dim)
        return torch.empty(shape, dtype=spec.dtype, device=self.device)

    def input_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """Stage 0's input for `tokens`: their embedding [1, T, hidden]."""
        if self.start != 0:
            raise InvalidInputError(f"stage [{self.start}, {self.end}) takes hidden states, not tokens")
        return self.backend.embed(tokens)

    @torch.inference_mode()
    def forward_into(self, hidden: torch.Tensor, shard: torch.Tensor, start: int) -> torch.Tensor:
        """Run the stage over `hidden` [1, T, hidden] (tokens at positions [start, start + T)), attending
        over the shard's tokens [0, start), which must hold their KV; writes the new KV to the shard's
        tokens [start, start + T) and returns the stage's output [1, T, hidden]."""
        n = int(hidden.shape[1])
        end = start + n
        if start < 0 or end > shard.shape[3] or shard.shape[0] != self.n_layers:
            raise InvalidInputError(f"a shard of {tuple(shard.shape)} cannot take tokens [{start}, {end})")
        first = self.start

        def place(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            kc, vc = shard[i - first, 0], shard[i - first, 1]
            kc[:, start:end].copy_(k[0])
            vc[:, start:end].copy_(v[0])
            return kc[None, :, :end], vc[None, :, :end]

        return self.backend.run_layers(
            hidden.to(self.device), start, start, place, range(self.start, self.end)
        )
