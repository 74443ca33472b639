#!/usr/bin/env bash
# The GPU check (docs/gpu.md): runs tests/gpu/gpu_check.py with the Python chosen here, with no
# venv, pip or apt of its own (a GPU machine without network works). Run from anywhere:
#
#   bash tests/gpu/run_checks.sh                                      # or: make gpu-check
#   HVD_GRADCOMP_GPU_CHECK_DRY_RUN=1 bash tests/gpu/run_checks.sh     # or: make gpu-check-dry
#
# Python: $PY if set; else $VENV/bin/python (default .venv) where `make setup` made one (a GPU
# machine with network: `make setup` builds Horovod with NCCL there); else python3 (a machine's
# own CUDA PyTorch). Options (report folder, dry run, Horovod from a local sdist): tests/gpu/gpu_check.py.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
py="${PY:-}"
if [ -z "$py" ]; then
  venv="${VENV:-$root/.venv}"
  if [ -x "$venv/bin/python" ]; then py="$venv/bin/python"; else py=python3; fi
fi
exec "$py" "$root/tests/gpu/gpu_check.py"
