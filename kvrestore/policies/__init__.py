"""Restore policies: pure decision objects (see `base.Policy`). `Auto`, which plans by simulating
them, lives in `kvrestore.planning`."""

from kvrestore.policies.base import ChunkStatus, Decision, Estimates, LaneTraits, Policy, Progress
from kvrestore.policies.blend import Blend
from kvrestore.policies.compute_only import ComputeOnly
from kvrestore.policies.load_only import LoadOnly
from kvrestore.policies.meeting import LayerTwoPointer, TokenTwoPointer


def available() -> list[Policy]:
    """One instance of every restore policy, with defaults (what `kvrestore demo` compares)."""
    return [ComputeOnly(), LoadOnly(), TokenTwoPointer(), LayerTwoPointer()]


__all__ = [
    "Blend",
    "ChunkStatus",
    "ComputeOnly",
    "Decision",
    "Estimates",
    "LaneTraits",
    "LayerTwoPointer",
    "LoadOnly",
    "Policy",
    "Progress",
    "TokenTwoPointer",
    "available",
]
