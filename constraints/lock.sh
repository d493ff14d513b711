#!/usr/bin/env bash
# Refresh the pins: resolve '.[cpu,test]' afresh in a scratch venv (no constraints), then write
# constraints/cpu.txt (the whole install) and constraints/gpu.txt (the versions that shape the
# built-in models, the tests' expectations and the API; vllm==0.32.0 brings its own CUDA torch).
# Then resolve instructor (with the newest openai it accepts) in a second scratch venv and write
# constraints/instructor.txt: instructor pins a jiter the newest openai cannot use, so the tests run it
# from its own venv (`make instructor`, .venv-instructor). Run by `make lock`; commit the three files,
# then `make clean test`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
"$PYTHON" -m venv "$scratch/venv"
"$scratch/venv/bin/pip" install -q -e '.[cpu,test]'
"$scratch/venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$scratch/venv/bin/pip" freeze --exclude-editable > "$scratch/freeze.txt"
{ echo "# The whole CPU install (make setup, EXTRAS=cpu,test), pinned: 'make lock' rewrites it (README, 'Pins')."
  cat "$scratch/freeze.txt"; } > constraints/cpu.txt
shaping='^(tokenizers|transformers|huggingface-hub|safetensors|xgrammar|openai|anthropic|pydantic|pydantic_core|fastapi'
shaping+='|starlette|uvicorn|ray|numpy|pytest|pytest-timeout|pytest-xdist|execnet|ruff|schemathesis|hypothesis|httpx|prometheus_client|pyyaml'
shaping+='|jinja2|pillow|sentencepiece|tiktoken|langchain-openai|langchain-core|openai-agents|lm_eval|guidellm)=='
{ echo "# GPU nodes (make setup EXTRAS=gpu,test): the versions that shape the built-in models, the tests' expectations"
  echo "# and the API, as in cpu.txt ('make lock' rewrites both); vllm==0.32.0 brings its own CUDA torch."
  grep -iE "$shaping" "$scratch/freeze.txt"; } > constraints/gpu.txt
"$PYTHON" -m venv "$scratch/instructor"
"$scratch/instructor/bin/pip" install -q 'instructor>=1.17' openai
{ echo "# instructor's own venv (make instructor, .venv-instructor; tests/clients/instructor_client.py): installed"
  echo "# with -r, as is. 'make lock' rewrites it (README, 'Pins')."
  "$scratch/instructor/bin/pip" freeze; } > constraints/instructor.txt
echo "constraints/cpu.txt: $(grep -vc '^#' constraints/cpu.txt) pins; constraints/gpu.txt: $(grep -vc '^#' constraints/gpu.txt);" \
     "constraints/instructor.txt: $(grep -vc '^#' constraints/instructor.txt)"
