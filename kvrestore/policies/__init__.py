"""Restore policies: pure decision objects (see `base.Policy`)."""

from .base import ChunkStatus, Decision, Policy, Progress
from .compute_only import ComputeOnly
from .load_only import LoadOnly

__all__ = ["ChunkStatus", "ComputeOnly", "Decision", "LoadOnly", "Policy", "Progress"]
