"""Restore policies: pure decision objects (see `base.Policy`)."""

from .base import ChunkStatus, Decision, Policy, Progress
from .blend import Blend
from .compute_only import ComputeOnly
from .layer_two_pointer import LayerTwoPointer
from .load_only import LoadOnly
from .token_two_pointer import TokenTwoPointer


def __getattr__(name: str) -> object:
    # the planner runs the simulator, which needs this package's base classes: import it on first use
    if name in ("Auto", "Plan"):
        from . import planner

        return getattr(planner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def available() -> list[Policy]:
    """One instance of every restore policy, with defaults (what `kvrestore demo` compares)."""
    return [ComputeOnly(), LoadOnly(), TokenTwoPointer(), LayerTwoPointer()]


__all__ = [
    "Auto",
    "Blend",
    "ChunkStatus",
    "ComputeOnly",
    "Decision",
    "LayerTwoPointer",
    "LoadOnly",
    "Plan",
    "Policy",
    "Progress",
    "TokenTwoPointer",
    "available",
]
