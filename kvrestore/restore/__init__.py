"""Running restores: one restore or save end to end (`run`), along tokens (`token_wise`) or layers
(`layer_wise`), with the compute lane's units (`compute`) and what comes back (`results`).

It sits between planning/ (what to run) and the `Restorer` facade (what a serving process calls).
"""

from kvrestore.restore.results import Job, Parts, RestoreResult, RestoreStats

__all__ = ["Job", "Parts", "RestoreResult", "RestoreStats"]
