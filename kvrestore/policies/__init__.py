"""Restore policies: pure decision objects (see `base.Policy`)."""

from .base import ChunkStatus, Decision, Policy, Progress
from .blend import Blend
from .compute_only import ComputeOnly
from .layer_two_pointer import LayerTwoPointer
from .load_only import LoadOnly
from .token_two_pointer import TokenTwoPointer


def available() -> list[Policy]:
    """One instance of every restore policy, with defaults (what `kvrestore demo` compares)."""
    return [ComputeOnly(), LoadOnly(), TokenTwoPointer(), LayerTwoPointer()]


__all__ = [
    "Blend",
    "ChunkStatus",
    "ComputeOnly",
    "Decision",
    "LayerTwoPointer",
    "LoadOnly",
    "Policy",
    "Progress",
    "TokenTwoPointer",
    "available",
]
