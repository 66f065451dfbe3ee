#!/bin/bash
# The first call on a lent GPU host (README.md beside this file): park the bundle's part 2, install the
# small wheels, run the CUDA tests and gpu_restore at 16k tokens with its profile.
export PYTHONUNBUFFERED=1
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD
(mkdir -p /tmp/vb && cp .vb2/*.tar /tmp/vb/ && echo "part 2 parked") &
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
timeout 70 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_blend.py tests/test_two_pointer.py \
  tests/test_chunkio.py tests/test_layer_reads.py --junitxml="$OUT/cuda-tests.xml" > "$OUT/cuda-tests.log" 2>&1
echo "cuda tests rc=$? at $((SECONDS - T0)) s"; tail -8 "$OUT/cuda-tests.log"
timeout 150 python3 benchmarks/gpu_restore.py --tokens 16384 --rounds 2 --profile \
  --out "$OUT/gpu_restore-h100.json" > "$OUT/gpu_restore.log" 2>&1
echo "gpu_restore rc=$? at $((SECONDS - T0)) s"
grep -A30 "16384 tokens on" "$OUT/gpu_restore.log" | grep -v "^\s*$" | head -40
wait; echo "done at $((SECONDS - T0)) s"
