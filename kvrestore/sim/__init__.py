"""The simulator: restores and batches of requests on a simulated clock, and seeded workloads."""
