#!/usr/bin/env bash
# tests/gpu on a lent device machine, which has torch and transformers but neither Ray nor vLLM:
# which GEMMs are row-invariant (probe_gemm.py), the shape-model tests, then the in-process diffusion benchmark (tandem_tools.bench.device).
# Here, once: python -m pip download --no-deps --only-binary=:all: --python-version 3.12
#   --implementation cp -d .whl transformers==<constraints/gpu.txt's>   (the image's is older;
#   .whl/ is git-ignored, so the run names it in carry)
# There (the device tool's run, carry [".whl"]): bash tests/gpu/device_run.sh; results under $OUT.
# Its timeouts add up to 540 s by default, inside one device call (600 s at most); the prefix
# section is off by default: PREFIX_S=150 in a second call when device time is left.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/env.txt"
timeout "${PROBE_S:-60}" python3 tests/gpu/probe_gemm.py cuda 2>&1 | tee "$OUT/probe_gemm.log"
timeout "${GPU_TESTS_S:-240}" python3 -m pytest tests/gpu -q -rs -s -p no:cacheprovider \
  -W ignore::UserWarning -W ignore::FutureWarning 2>&1 | tee "$OUT/gpu_tests.log"
# (throughput with --graphs: tandem fast in its device form too, compiled in the warm-up)
timeout "${BENCH_S:-240}" python3 -m tandem_tools.bench.device --sections throughput --graphs \
  --out "$OUT/throughput.json" \
  2>&1 | grep -v "Loading weights" | tee "$OUT/throughput.log"
if [ "${PREFIX_S:-0}" != 0 ]; then
  timeout "$PREFIX_S" python3 -m tandem_tools.bench.device --sections prefix --out "$OUT/prefix.json" \
    2>&1 | grep -v "Loading weights" | tee "$OUT/prefix.log"
fi
