#!/usr/bin/env bash
# `make gpu-check` on a CUDA machine that has torch, transformers, peft, safetensors and fsspec and maybe no network:
# the wheels in .whl/ (scripts/gpu_wheels.sh, run where pip reaches PyPI) go into a folder of their own on the path,
# then bench.gpu_check checks and times the trainer and writes bench/RESULTS-gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  SITE=${TMPDIR:-/tmp}/trace-rl-gpu-check-site
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PYTHON" -m bench.gpu_check "$@"
