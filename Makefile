# hvd-gradcomp: `make demo` runs the main job, `make test` the whole test suite.
# Both run `make setup` first (idempotent; see .ci/setup.sh and README.md).
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
export VENV
export TF_CPP_MIN_LOG_LEVEL ?= 2
export PYTHONDONTWRITEBYTECODE = 1

.PHONY: setup test demo clean gpu-check

setup:
	bash .ci/setup.sh

test: setup
	$(PY) -m pytest tests -q -p no:cacheprovider $(PYTEST_ARGS)

demo: setup
	$(PY) -m hvd_gradcomp.bench tta $(DEMO_ARGS)

# On a machine with a CUDA GPU: the GPU tests, the overhead bench and a short TTA sweep on the
# device (tests/gpu/run_checks.sh, docs/gpu.md).
gpu-check: setup
	PY=$(PY) bash tests/gpu/run_checks.sh

clean:
	rm -rf $(VENV) runs
