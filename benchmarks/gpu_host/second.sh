#!/bin/bash
# The second call on a lent GPU host (README.md beside this file): vLLM 0.26 from the two parts, the
# connector's GPU test, then vllm_gpu at 16k tokens in the seconds left of BUDGET (the first argument).
export PYTHONUNBUFFERED=1
T0=$SECONDS; BUDGET=${1:-520}
left() { echo $((BUDGET - (SECONDS - T0))); }
if [ ! -d /tmp/vllm-site/vllm ]; then
  test -f /tmp/vb/vllm-bundle-02-of-02.tar || { echo "a fresh machine: part 2 is gone, run first.sh"; exit 3; }
  cp .vb1/*.tar /tmp/vb/ && (cd /tmp/vb && tar -xf vllm-bundle-01-of-02.tar install.sh \
    && bash install.sh /tmp/vllm-site) > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 4; }
fi
echo "vLLM installed at $((SECONDS - T0)) s"
export PYTHONPATH=/tmp/vllm-site:/tmp/site:$PWD
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests_vllm/test_gpu.py > "$OUT/test_gpu.log" 2>&1
echo "test_gpu rc=$? at $((SECONDS - T0)) s"; tail -30 "$OUT/test_gpu.log"
timeout $(($(left) - 5)) python3 benchmarks/vllm_gpu.py --tokens 16384 --rounds 1 --factors 1 --eager \
  --timeout 150 --skip SimpleCPUOffloadConnector "kvrestore load-all (file)" \
  --out "$OUT/vllm_gpu-h100.json" > "$OUT/vllm_gpu.log" 2>&1
echo "vllm_gpu rc=$? at $((SECONDS - T0)) s"
grep -v "^\s*$" "$OUT/vllm_gpu.log" | grep -v "^INFO\|^(EngineCore\|WARNING" | tail -30
