"""Token-wise two-pointer vs compute-only vs load-only across bandwidths (issue 3's benchmark).

    python benchmarks/two_pointer.py            # 4096 tokens, 0.25x-4x balance, 3 rounds, fluctuation run

Prints the tables and writes benchmarks/results/two_pointer.json and benchmarks/results/two_pointer.png.
The same benchmark is `kvrestore bench` (see kvrestore/tools/bench.py for what is measured and how).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvrestore.tools.cli import main

RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    args = sys.argv[1:] or []
    sys.exit(
        main(
            ["bench", "--json", str(RESULTS / "two_pointer.json"), "--plot", str(RESULTS / "two_pointer.png")]
            + args
        )
    )
