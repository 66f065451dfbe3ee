"""Layer checks that never stop the host: device checksums compared on the device, read back once.

A layer read into a CUDA cache is checked by its sections' device checksums (`segment_checksums`).
Reading those sums back to compare them on the host costs a round trip per layer: the loader waits for
the device, behind whatever compute is queued there, before it can queue the next layer. A restore
that keeps its cache to itself until it ends (CacheBlend's fusor) can instead place every section at
once, compare the sums with the headers' on the device into one flag per (layer, chunk), and read the
flags once, at the end: a damaged section then costs a restart with that chunk recomputed -- what a
damaged section costs anyway -- and still never reaches a result.

`DeferredChecks` holds those flags and each layer's upload events: `placed` (when a layer's sections,
checks and placement are all queued), so the compute stream waits for a layer on the device, and the
loader runs at most `ahead` layers in front of the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

import torch

from kvrestore import codec
from kvrestore.core.streams import HostEvent, on_stream, timing_event, wait_on_device


class DeferredChecks:
    """The device-side checks and upload events of one restore's layer reads (see the module doc).

    Not thread-safe: one loader thread queues the layers; other threads only wait on their events.
    """

    def __init__(
        self, headers: Mapping[int, codec.ChunkHeader], n_chunks: int, n_layers: int, device: torch.device
    ) -> None:
        table = [[0] * n_chunks for _ in range(n_layers)]
        for j, header in headers.items():
            for layer, section in enumerate(header.layers):
                table[layer][j] = section.device_sum or 0
        self.device = device
        self.expected = torch.tensor(table, dtype=torch.int64).to(device)
        self.bad = torch.zeros((n_layers, n_chunks), dtype=torch.bool, device=device)
        self.events: dict[int, tuple[torch.cuda.Event | HostEvent, torch.cuda.Event | HostEvent]] = {}
        self._in_flight: deque[torch.cuda.Event | HostEvent] = deque()
        self._begin: torch.cuda.Event | HostEvent = HostEvent()  # where the layer being queued began
        self._index: dict[tuple[int, ...], torch.Tensor] = {}

    def throttle(self, ahead: int) -> None:
        """Block (this loader thread only) until fewer than `ahead` queued layers are still on the device."""
        while len(self._in_flight) >= max(ahead, 1):
            self._in_flight.popleft().synchronize()

    def start(self, layer: int) -> None:
        """Mark where `layer`'s uploads begin on the current stream."""
        self._begin = timing_event(self.device)
        self._begin.record()

    def note(self, layer: int, chunks: Sequence[int], sums: torch.Tensor) -> None:
        """Flag, on the device, the sections of `chunks` (in order) whose checksum in `sums` is wrong."""
        key = tuple(chunks)
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = torch.tensor(key, dtype=torch.int64).to(self.device)
        self.bad[layer].index_copy_(0, index, sums != self.expected[layer].index_select(0, index))

    def placed(self, layer: int) -> None:
        """Mark that everything of `layer` is queued on the current stream."""
        end = timing_event(self.device)
        end.record()
        self.events[layer] = (self._begin, end)
        self._in_flight.append(end)

    def wait(self, layer: int) -> None:
        """Make the current stream wait for `layer` to be in place (the host does not wait)."""
        if layer in self.events:
            wait_on_device(self.events[layer][1])

    def seconds(self, layer: int) -> float | None:
        """How long the device took to place `layer` (waits for it); None if it was not read this way."""
        if layer not in self.events:
            return None
        begin, end = self.events[layer]
        if isinstance(end, HostEvent):  # placed by the loader itself, within its own time
            return 0.0
        end.synchronize()
        return begin.elapsed_time(end) / 1e3  # type: ignore[arg-type]

    def failures(self, stream: torch.cuda.Stream | None) -> dict[int, int]:
        """Wait for every queued layer, then {chunk: its first damaged layer}; clears the flags."""
        if stream is not None:
            stream.synchronize()
        with on_stream(stream):  # cleared on the stream that sets them: in order with the next layers
            bad = self.bad.to("cpu", copy=True)  # a copy: the flags are cleared next
            self.bad.zero_()
        self._in_flight.clear()
        found: dict[int, int] = {}
        for layer, j in bad.nonzero().tolist():
            found.setdefault(j, layer)
        return found
