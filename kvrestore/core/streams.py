"""CUDA stream helpers shared by the engine's lanes and the chunk data path."""

from __future__ import annotations

import contextlib

import torch


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """`torch.cuda.stream(stream)`, or nothing to do off CUDA."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
