#!/usr/bin/env bash
# tests/gpu on a lent device machine, which has torch and transformers but neither Ray nor vLLM:
# which GEMMs are row-invariant (probe_gemm.py), the shape-model tests, then the in-process diffusion benchmark (tandem_tools.bench_device).
# Here, once: python -m pip download --no-deps --only-binary=:all: --python-version 3.12
#   --implementation cp -d .whl transformers==<constraints/gpu.txt's>   (the image's is older)
# There (the device tool's run, carry [".whl"]): bash tests/gpu/device_run.sh; results under $OUT.
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
timeout 120 python3 tests/gpu/probe_gemm.py cuda 2>&1 | tee "$OUT/probe_gemm.log"
timeout "${GPU_TESTS_S:-300}" python3 -m pytest tests/gpu -q -rs -s -p no:cacheprovider \
  -W ignore::UserWarning -W ignore::FutureWarning 2>&1 | tee "$OUT/gpu_tests.log"
# (throughput with --graphs: tandem fast with the trunk compiled and replayed as CUDA graphs too.
#  Worst case of all the timeouts ~13 min: with less device time left, PREFIX_S=0.)
timeout "${BENCH_S:-210}" python3 -m tandem_tools.bench_device --sections throughput --graphs \
  --out "$OUT/throughput.json" \
  2>&1 | grep -v "Loading weights" | tee "$OUT/throughput.log"
if [ "${PREFIX_S:-150}" != 0 ]; then
  timeout "${PREFIX_S:-150}" python3 -m tandem_tools.bench_device --sections prefix --out "$OUT/prefix.json" \
    2>&1 | grep -v "Loading weights" | tee "$OUT/prefix.log"
fi
