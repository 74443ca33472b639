# hvd-gradcomp: `make demo` runs the main job, `make test` the whole test suite.
# Both run `make setup` first (idempotent; see .ci/setup.sh and README.md).
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
export VENV
export TF_CPP_MIN_LOG_LEVEL ?= 2
export PYTHONDONTWRITEBYTECODE = 1

.PHONY: setup test demo clean gpu-check gpu-check-dry

setup:
	bash .ci/setup.sh

test: setup
	$(PY) -m pytest tests -q -p no:cacheprovider $(PYTEST_ARGS)

demo: setup
	$(PY) -m hvd_gradcomp.bench tta $(DEMO_ARGS)

# On a machine with a CUDA GPU, network or not: the GPU tests, the overhead bench and, with
# Horovod (or HVD_GRADCOMP_HOROVOD_SDIST=<sdist>), its NCCL test; no set-up of its own (with
# network, `make setup` first makes .venv, which it then uses). gpu-check-dry: the same logic
# on a CPU machine. Report: runs/gpu-check/ (tests/gpu/gpu_check.py, docs/gpu.md).
gpu-check:
	bash tests/gpu/run_checks.sh

gpu-check-dry:
	HVD_GRADCOMP_GPU_CHECK_DRY_RUN=1 bash tests/gpu/run_checks.sh

clean:
	rm -rf $(VENV) runs
