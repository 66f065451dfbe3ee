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

Where the pointers meet is decided as along tokens (`policies.meeting`, shared with `TokenTwoPointer`):
the units are layers, each holding the prefix's token count in `Progress.chunk_tokens`.
"""

from __future__ import annotations

from kvrestore.core.errors import check_int
from kvrestore.policies.base import Decision, Estimates, Policy, Progress
from kvrestore.policies.meeting import Meeting

#: layers per compute unit (the first unit is one layer, to measure the lane; units shrink near the meeting)
DEFAULT_COMPUTE_LAYERS = 2


class LayerTwoPointer(Policy):
    """Compute layers from the bottom, load layers from the top, meet at the cutover layer."""

    name = "layer-wise"
    axis = "layers"

    def __init__(self, compute_layers: int = DEFAULT_COMPUTE_LAYERS) -> None:
        self.compute_layers = check_int("compute_layers", compute_layers)
        self._meeting = Meeting(self.compute_layers)

    def __repr__(self) -> str:
        return f"LayerTwoPointer(compute_layers={self.compute_layers})"

    def decide(self, progress: Progress, estimates: Estimates) -> Decision:
        return self._meeting.decide(progress, estimates)
