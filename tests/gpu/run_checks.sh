#!/usr/bin/env bash
# The GPU checks of issue 26, for a machine with a CUDA GPU (docs/gpu.md). About 5-8 minutes on
# one H200 once set up (`make setup`, which builds Horovod with NCCL there). Run from anywhere:
#
#   bash tests/gpu/run_checks.sh            # or: make gpu-check
#
# Environment: PY (default .venv/bin/python, else python3), OUT (default runs/gpu-check),
# GPU_CHECK_COMPILE=1 also times the compiled (Triton) kernels (adds ~1-2 minutes).
# Steps (each one's status is printed; the script exits 1 if any failed, 2 without a GPU):
#   1. environment: GPUs, PyTorch/TensorFlow CUDA, `horovodrun --check-build` (NCCL listed?);
#   2. GPU tests: tests/core device tests (cuda params: each scheme's round trip, compiled
#      kernels through Triton, select), the NCCL-Average emulation, no-sync checks under
#      torch.cuda.set_sync_debug_mode("error"), and tests/parallel/test_gpu.py
#      (the compressors through Horovod's NCCL all-reduce, one rank per GPU, at most 2);
#   3. overhead bench at 2^24 on the GPU with CUDA events; target: THC <= 5x and TopKC <= 2x
#      the fp16 cast's median (reported, not enforced: the numbers go to docs/gpu.md);
#   4. a short TTA sweep with --device cuda (loopback, workers = min(2, GPUs), 60 steps).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
PY="${PY:-$root/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
OUT="${OUT:-runs/gpu-check}"
mkdir -p "$OUT"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" TF_CPP_MIN_LOG_LEVEL=2 PYTHONDONTWRITEBYTECODE=1
status=0
step() { printf '\n=== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }
result() { if [ "$1" = 0 ]; then echo "[gpu-check] $2: ok"; else echo "[gpu-check] $2: FAILED ($1)"; status=1; fi; }

step "1. environment"
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "[gpu-check] no GPU (nvidia-smi lists none): nothing to check here"; exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" - <<'PY'
import torch, horovod
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "gpus", torch.cuda.device_count())
import horovod.torch as hvd
print("horovod", horovod.__version__, "nccl_built", hvd.nccl_built())
try:
    import tensorflow as tf
    print("tensorflow", tf.__version__, "gpus", len(tf.config.list_physical_devices("GPU")))
except Exception as e:  # noqa: BLE001
    print("tensorflow not usable:", e)
PY
check=$("$(dirname "$PY")/horovodrun" --check-build 2>/dev/null || true)
echo "$check" | grep '\[X\]'
grep -q '\[X\] NCCL' <<<"$check"; result $? "horovod lists NCCL"
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")

step "2. GPU tests"
# (test_primitives: the compiled kernels on CUDA meet Triton; their CPU twins are CI's.)
timeout 360 "$PY" -m pytest -q -p no:cacheprovider -rs \
  tests/core/test_devices.py tests/core/test_nccl_average.py tests/core/test_primitives.py \
  tests/parallel/test_gpu.py -k "not (test_compiled_kernels_match_uncompiled and cpu)" \
  2>&1 | tee "$OUT/pytest.txt" | tail -25
result "${PIPESTATUS[0]}" "GPU tests"
grep -q "no CUDA device\|no GPU visible" "$OUT/pytest.txt" && echo "[gpu-check] note: some tests skipped for lack of a device (see above)"

step "3. overhead at 2^24 (CUDA events)"
compile=off
[ "${GPU_CHECK_COMPILE:-0}" = 1 ] && compile=both
timeout 240 "$PY" -m hvd_gradcomp.bench overhead --frameworks torch --devices gpu --min-log2 24 \
  --max-log2 24 --layers none --schemes "fp16;topkc;thc;powersgd:rank=4" --compile "$compile" \
  --reps 30 --budget 5 --out "$OUT/overhead" 2>&1 | tail -15
result "${PIPESTATUS[0]}" "overhead bench"
"$PY" - "$OUT/overhead/overhead.csv" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["device"] == "gpu" and r["median_ms"]]
fp16 = {r["case"]: float(r["median_ms"]) for r in rows if r["spec"] == "fp16"}
for r in rows:
    ratio = float(r["median_ms"]) / fp16[r["case"]]
    limit = {"topkc": 2.0, "thc": 5.0}.get(r["spec"].split("+")[0])
    verdict = "" if limit is None else ("  target <= %gx: %s" % (limit, "met" if ratio <= limit else "MISSED"))
    print(f"[gpu-check] {r['case']:>10} {r['spec']:<24} {float(r['median_ms']):9.3f} ms  {ratio:6.2f}x fp16{verdict}")
PY

step "4. TTA sweep, --device cuda"
workers=$(( gpus < 2 ? gpus : 2 ))
timeout 300 "$PY" -m hvd_gradcomp.bench tta --device cuda --loopback --workers "$workers" \
  --workloads digits --compressors "none;fp16;topkc:ratio=0.1;thc;powersgd:rank=4" --ddp-hooks "fp16" \
  --no-comm-reference off --skip-link-check --max-seconds 60 --worker-args "--max-steps 60" \
  --no-progress --out "$OUT/tta" 2>&1 | tail -25
result "${PIPESTATUS[0]}" "TTA sweep"

step "done"
echo "[gpu-check] results under $OUT (pytest.txt, overhead/, tta/); exit $status"
exit $status
