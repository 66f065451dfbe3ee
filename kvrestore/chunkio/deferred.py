"""Layer checks that never stop the host: device checksums compared on the device, read back once.

A layer read into a CUDA cache is checked by its sections' device checksums (`segment_checksums`).
Reading those sums back to compare them on the host costs a round trip per layer: the loader waits for
the device, behind whatever compute is queued there, before it can queue the next layer. A restore
that keeps its cache to itself until it ends (CacheBlend's fusor) can instead place every section at
once, compare the sums with the headers' on the device into one flag per (layer, chunk), and read the
flags once, at the end: a damaged section then costs a restart with that chunk recomputed -- what a
damaged section costs anyway -- and still never reaches a result.

`DeferredChecks` holds those flags and each read's upload events: `placed` (when the sections, checks
and placement of a read's layers are all queued), so the compute stream waits for a layer on the
device, and the loader runs at most `ahead` layers in front of the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

import torch

from kvrestore import codec
from kvrestore.core.streams import HostEvent, on_stream, timing_event, upload, wait_on_device


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
        self.expected = upload(torch.tensor(table, dtype=torch.int64), device)
        self.bad = torch.zeros((n_layers, n_chunks), dtype=torch.bool, device=device)
        # layer -> (where its read began, where it ended, how many layers that read placed)
        self.events: dict[int, tuple[torch.cuda.Event | HostEvent, torch.cuda.Event | HostEvent, int]] = {}
        # reads' ends, their layers, and the host memory they upload from that no staging buffer owns
        self._in_flight: deque[tuple[torch.cuda.Event | HostEvent, int, list[torch.Tensor]]] = deque()
        self._held: list[torch.Tensor] = []  # that memory, of the read being queued
        self._begin: torch.cuda.Event | HostEvent = HostEvent()  # where the read being queued began
        self._index: dict[tuple[int, ...], torch.Tensor] = {}

    @property
    def in_flight(self) -> int:
        """Layers queued on the device and not known to be placed yet."""
        return sum(n for _, n, _ in self._in_flight)

    def throttle(self, ahead: int, adding: int = 1) -> None:
        """Block (this loader thread only) until `adding` more layers keep at most `ahead` queued on the
        device (one read at a time if it alone is more)."""
        while self._in_flight and self.in_flight + adding > max(ahead, 1):
            self._in_flight.popleft()[0].synchronize()

    def hold(self, host: torch.Tensor) -> None:
        """Keep `host` (an upload's source no staging buffer owns: a pinned store's object) alive until
        the read being queued is known to be placed: the host does not wait for the upload, and the
        store may drop the object meanwhile, handing its page-locked memory to another tensor."""
        self._held.append(host)

    def start(self) -> None:
        """Mark where the next read's uploads begin on the current stream."""
        self._begin = timing_event(self.device)
        self._begin.record()

    def note(self, layers: range, chunks: Sequence[int], sums: torch.Tensor) -> None:
        """Flag, on the device, the sections of `layers` of `chunks` whose checksum in `sums` is wrong
        (chunk by chunk, each chunk's layers in order)."""
        key = tuple(chunks)
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = upload(torch.tensor(key, dtype=torch.int64), self.device)
        a, b = layers.start, layers.stop
        wrong = self.expected[a:b].index_select(1, index) != sums.view(len(chunks), b - a).T
        self.bad[a:b].index_copy_(1, index, wrong)

    def placed(self, layers: range) -> None:
        """Mark that everything of `layers` (the read begun at `start`) is queued on the current stream."""
        end = timing_event(self.device)
        end.record()
        for layer in layers:
            self.events[layer] = (self._begin, end, len(layers))
        self._in_flight.append((end, len(layers), self._held))
        self._held = []

    def wait(self, layer: int) -> None:
        """Make the current stream wait for `layer` to be in place (the host does not wait)."""
        if layer in self.events:
            wait_on_device(self.events[layer][1])

    def seconds(self, layer: int) -> float | None:
        """How long the device took to place `layer` (waits for it; a read of n layers counts 1/n of its
        time for each); None if it was not read this way."""
        if layer not in self.events:
            return None
        begin, end, n = self.events[layer]
        if isinstance(end, HostEvent):  # placed by the loader itself, within its own time
            return 0.0
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / n  # type: ignore[arg-type]

    def failures(self, stream: torch.cuda.Stream | None) -> dict[int, int]:
        """Wait for every queued layer, then {chunk: its first damaged layer}; clears the flags."""
        # cleared on the stream that sets them (`stream`, else the device's current one): in order with
        # the next layers
        with on_stream(stream, self.device):
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            bad = self.bad.to("cpu", copy=True)  # a copy: the flags are cleared next
            self.bad.zero_()
        self._in_flight.clear()
        found: dict[int, int] = {}
        for layer, j in bad.nonzero().tolist():
            found.setdefault(j, layer)
        return found
