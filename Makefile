# The quickstart: `make demo` and `make test`. Both set up .venv first, once per dependency spec.
# `make demo` trains the real SmolLM2-135M-Instruct (configs/math.toml: 10 steps, 1.7 minutes measured on 2 idle
# AMX cores in bfloat16, 13 on 2 busy AVX2 ones in float32, see README.md); `make demo-tiny` is the one-minute run of the tiny random model (configs/demo.toml).
# Both pass --overwrite (README.md says so): running one again starts its run directory afresh instead of being
# refused.
VENV := .venv
SPEC_HASH := $(shell cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(SPEC_HASH)

.PHONY: setup demo demo-tiny test bench gpu-check clean

setup: $(STAMP)

$(STAMP):
	bash scripts/setup.sh
	rm -f $(VENV)/.installed-*
	touch $@

demo: setup
	$(VENV)/bin/trace-rl train configs/math.toml --overwrite

demo-tiny: setup
	$(VENV)/bin/trace-rl train configs/demo.toml --overwrite

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

BENCH_STAMP := $(VENV)/.bench-$(SPEC_HASH)

$(BENCH_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install -q -e ".[bench]"
	rm -f $(VENV)/.bench-*
	touch $@

bench: setup $(BENCH_STAMP)
	$(VENV)/bin/python -m bench.run_all

# on a CUDA machine (no .venv, no network needed): the trainer in bfloat16 on a Qwen2.5-0.5B-shaped model, checked
# and timed (bench.gpu_check), into bench/RESULTS-gpu.md; what the machine lacks comes from .whl/, which
# scripts/gpu_wheels.sh fills here first
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache
