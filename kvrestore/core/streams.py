"""CUDA stream helpers shared by the engine's lanes and the chunk data path."""

from __future__ import annotations

import contextlib
import time

import torch


def on_stream(
    stream: torch.cuda.Stream | None, device: torch.device | None = None
) -> contextlib.AbstractContextManager:
    """`torch.cuda.stream(stream)`. With no stream, on a CUDA `device`, that device's current stream:
    the device is entered (`on_device`), so the events recorded and the streams waited on without
    naming one are its, not device 0's. Nothing to do off CUDA."""
    if stream is not None:
        return torch.cuda.stream(stream)
    return on_device(device) if device is not None else contextlib.nullcontext()


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`torch.cuda.device(device)`, or nothing to do off CUDA. The current CUDA device is per thread and
    a new thread starts on device 0: a worker thread that records events or waits on `current_stream()`
    for a model on `cuda:1` enters this first, or it orders and times device 0's stream instead."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def load_stream(device: torch.device | str | int | None = None) -> torch.cuda.Stream:
    """A new stream for uploads, at high priority: its small kernels (checks, placement, re-rotation)
    are scheduled ahead of the compute stream's queued blocks, so a load the compute is about to wait
    for is not held up behind that compute."""
    return torch.cuda.Stream(device=device, priority=-1)


class HostEvent:
    """A stand-in for a CUDA event off CUDA (the device data path run on a CPU cache, in tests):
    complete as soon as it is recorded."""

    def __init__(self) -> None:
        self.at = 0.0

    def record(self, stream: object = None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to `end`, like `torch.cuda.Event.elapsed_time`."""
        return (end.at - self.at) * 1e3


def timing_event(device: torch.device) -> torch.cuda.Event | HostEvent:
    """An event that can time device work on `device` (a `HostEvent` off CUDA)."""
    return torch.cuda.Event(enable_timing=True) if device.type == "cuda" else HostEvent()


def wait_on_device(event: torch.cuda.Event | HostEvent) -> None:
    """Make the current stream wait for `event` without blocking the host (nothing to do off CUDA)."""
    if isinstance(event, torch.cuda.Event):
        torch.cuda.current_stream().wait_event(event)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (a table, an index) on `device`, queued on the current stream: through pinned
    memory on CUDA, since a copy from pageable memory makes the host wait for the stream to drain."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
