# hvd-gradcomp: `make demo` runs the main job, `make test` the whole test suite.
# Both run `make setup` first (idempotent; see .ci/setup.sh and README.md).
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
export VENV
export TF_CPP_MIN_LOG_LEVEL ?= 2
export PYTHONDONTWRITEBYTECODE = 1

.PHONY: setup test demo clean

setup:
	bash .ci/setup.sh

test: setup
	$(PY) -m pytest tests -q -p no:cacheprovider $(PYTEST_ARGS)

demo: setup
	$(PY) -m hvd_gradcomp.bench tta $(DEMO_ARGS)

clean:
	rm -rf $(VENV) runs
