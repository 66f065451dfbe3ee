"""LayerTwoPointer: the two-pointer along layers (CacheFlow §3.1, "layer-wise parallelism").

The compute lane runs the model bottom-up, layer 0, 1, 2, ... over every token of the stored prefix at
once; the load lanes fetch the stored KV top-down, layer L-1, L-2, ..., each layer one range read per
stored chunk (`layers.LayerReader`). They meet at a cutover layer that nobody planned. Computing layer l
needs the hidden states out of layer l-1, which only computing gives, so the computed layers are always
a bottom run and the loaded ones a top run.

Why a second axis: the token-wise two-pointer can split a prompt only at chunk boundaries, so a prompt of
a few hundred tokens (one or two chunks) cannot be split at all, while a model has dozens of layers.
Along layers every unit costs the same, though, whereas the first token chunks are cheaper to compute
than the last (attention grows with position), which the token-wise pointer exploits on long prompts.
The planner (`policies.planner.Auto`) picks between the two at the profiled crossover length L_delta.

The decisions are the token-wise pointer's (`TokenTwoPointer`): the units are layers instead of chunks,
and `Progress.chunk_tokens` holds the same token count for every layer.
"""

from __future__ import annotations

from kvrestore.core.errors import check_int
from kvrestore.policies.token_two_pointer import TokenTwoPointer

#: layers per compute unit (the first unit is one layer, to measure the lane; units shrink near the meeting)
DEFAULT_COMPUTE_LAYERS = 2


class LayerTwoPointer(TokenTwoPointer):
    """Compute layers from the bottom, load layers from the top, meet at the cutover layer."""

    name = "layer-wise"
    axis = "layers"

    def __init__(self, compute_layers: int = DEFAULT_COMPUTE_LAYERS) -> None:
        super().__init__(compute_chunks=check_int("compute_layers", compute_layers))

    def __repr__(self) -> str:
        return f"LayerTwoPointer(compute_layers={self.compute_chunks})"
