#!/usr/bin/env bash
# The wheels `make gpu-check` installs on a CUDA machine that has torch, transformers, peft, safetensors, fsspec and
# pyarrow but no network: the trainer's config (pydantic) and what pydantic needs, at the versions .venv has.
# Run here, where pip reaches PyPI; they land in .whl/ (git-ignored), for Python 3.12 on x86-64 manylinux.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
version() { "$PYTHON" -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .whl
mkdir -p .whl
for name in pydantic pydantic_core annotated_types typing_inspection typing_extensions; do
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$name==$(version "$name")"
done
ls .whl
