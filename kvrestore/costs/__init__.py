"""Measured costs: per-chunk compute costs and profiles, link models, costs learned from restores."""
