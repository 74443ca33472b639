"""The scale study's GPU-scaled step (hvd_gradcomp/bench/scale_gpu.py): the FLOPs count, the
compute at an MFU with its floor, the codec from docs/gpu.md's H200 figures scaled by memory
bandwidth, and the sweep block's GPU tables kept apart from the CPU-measured ones."""
import math
import types

import pytest

from hvd_gradcomp.bench import scale_gpu, scale_tables


def _result(metrics, steps, payload, compute=0.1, codec=0.01):
    return {"evals": {"step": steps, "metric": metrics}, "window": 1, "bytes": {
        "payload": payload, "side": 0, "side_collectives": 0}, "compute_s": compute, "codec_s": codec,
        "stop_reason": "budget", "steps_run": steps[-1]}


def test_step_flops_and_model_shape():
    torch = pytest.importorskip("torch")
    from hvd_gradcomp.bench import scale
    from hvd_gradcomp.bench.workers import torch_workloads
    assert scale_gpu.step_flops(1000, 4, 64, 128, 2) == 6 * 1000 * 256 + 6 * 2 * 64 * 128 * 256
    shape = scale_gpu.model_shape(torch_workloads.LMCommWorkload)
    assert shape == {"context": 64, "width": 128, "layers": 2}
    params = sum(p.numel() for p in torch_workloads.LMCommWorkload(0, 1, 0, 2).model().parameters())
    assert scale.model_params("lm-comm") == params == 470_528


def test_gpu_parts_compute_floor_and_codec_scaling():
    h100, h200 = scale_gpu.GPU_CLASSES["h100-sxm"], scale_gpu.GPU_CLASSES["h200"]
    res = _result([10.0, 4.0], [0, 10], 1000)
    results = {2: {"fp16": res, "thc:bits=2,error_feedback=false": res, "powersgd:rank=4": res,
                   "mystery": res}}
    flops = 4e11  # 1.01 ms at 40% of 989.4 TFLOP/s: above a 1 ms floor
    parts = scale_gpu.gpu_parts(results, h100, 2_000_000, flops, mfu=0.4, floor_s=1e-3)
    assert (2, "mystery") not in parts  # no GPU figure: left out, not guessed
    want_compute = flops / (989.4e12 * 0.4)
    assert parts[(2, "fp16")]["compute_s"] == pytest.approx(want_compute) and want_compute > 1e-3
    # codec: ms per M params x 2M params x (4.8 / 3.35): THC's variants take THC's figure
    assert parts[(2, "thc:bits=2,error_feedback=false")]["codec_s"] == pytest.approx(0.40e-3 * 2 * 4.8 / 3.35)
    assert parts[(2, "powersgd:rank=4")]["codec_s"] == pytest.approx(235 / 9.61 * 1e-3 * 2 * 4.8 / 3.35)
    on_h200 = scale_gpu.gpu_parts(results, h200, 2_000_000, 1e6, mfu=0.4, floor_s=1e-3)
    assert on_h200[(2, "fp16")] == {"compute_s": 1e-3, "codec_s": pytest.approx(0.07e-3 * 2)}  # the floor
    with pytest.raises(ValueError, match="mfu"):
        scale_gpu.gpu_parts(results, h100, 1, 1e6, mfu=0.0)
    with pytest.raises(KeyError, match="no GPU codec figure"):
        scale_gpu.codec_ms_per_mparam("mystery:x=1")


def test_sweep_block_keeps_cpu_and_gpu_tables_apart():
    """With a GPU's parts the block holds a second runs table and winners table, labelled; the
    fast GPU compute makes the link decide, so the smaller payload wins where the CPU's slow
    codec made FP16 win."""
    fp16 = _result([10.0, 5.0, 4.0], [0, 10, 20], 2_000_000, compute=0.05, codec=0.001)
    small = _result([10.0, 6.0, 3.9], [0, 10, 20], 100_000, compute=0.05, codec=0.02)
    results = {8: {"fp16": fp16, "topkc": small}}
    opts = types.SimpleNamespace(workload="lm-comm", layout="tensor", batch_size=16, max_epochs=0.5, seed=0,
                                 calibrate_at="2,8")
    gpu = {"parts": {(8, "fp16"): {"compute_s": 1e-3, "codec_s": 1e-5},
                     (8, "topkc"): {"compute_s": 1e-3, "codec_s": 1e-4}}, "label": "one NVIDIA H100 SXM: test"}
    text = scale_tables.sweep_block(results, [1.0, 100.0], 2 / 3, "abc", opts, None, gpu)
    cpu, _, rest = text.partition("**Simulated steps, GPU-scaled step**")
    assert rest and "one NVIDIA H100 SXM: test" in rest and "GPU compute ms" in rest
    assert "GPU compute ms" not in cpu
    soonest_cpu = [ln for ln in cpu.splitlines() if ln.startswith("| 8 |")][-1].split("|")
    soonest_gpu = [ln for ln in rest.splitlines() if ln.startswith("| 8 |")][-1].split("|")
    assert soonest_cpu[3].strip().startswith("fp16")  # 100 Gbit/s on the CPU: the codec decides
    assert soonest_gpu[3].strip().startswith("topkc")  # on the GPU: the bytes do
    gpu_row = [ln for ln in rest.splitlines() if ln.startswith("| 8 | topkc |")][0].split("|")
    steps, step_s, tta = scale_tables.modelled_tta(small, 1.02 * 4.0, 8, 1.0, 0.0, gpu["parts"][(8, "topkc")])
    assert gpu_row[6].strip() == "1.0" and gpu_row[7].strip() == "0.1"  # ms
    assert math.isclose(float(gpu_row[8]), tta, abs_tol=5e-4)
    assert scale_tables.sweep_block(results, [1.0], 2 / 3, "abc", opts).count("GPU") == 0
