"""Planning: `Auto` predicts each strategy through the simulator and picks the fastest."""

from kvrestore.planning.auto import Auto, Plan

__all__ = ["Auto", "Plan"]
