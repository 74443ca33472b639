"""The overhead benchmark in a reduced mode: output schema, reference ratios, floors.

One small tensor (2^10 coordinates), 2 timed calls, every registered compressor, in
each backend under test. The timings themselves are not checked (this machine is shared);
their presence, sign and the exact bookkeeping around them are.
"""
import csv
import json
import math

import pytest

from hvd_gradcomp.base import TensorInfo
from hvd_gradcomp.bench import model, overhead, overhead_timing
from hvd_gradcomp.registry import SCHEMES, make_scheme, parse_spec
from hvd_gradcomp.routing import Routing
from tests.backends import BACKENDS, backend_ops, usable_backends

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("overhead")
    argv = ["--frameworks", ",".join(usable_backends()), "--devices", "cpu", "--min-log2", "10",
            "--max-log2", "10", "--layers", "none", "--warmup", "1", "--reps", "2", "--min-reps", "2", "--budget", "0", "--threads", "0", "--malloc", "system",
            "--copy-mib", "8", "--ddp-hooks", "off", "--out", str(out)]
    assert overhead.main(argv) == 0
    with open(out / "overhead.csv", newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)
    return {"header": header, "rows": rows, "text": (out / "overhead.txt").read_text()}


def test_csv_columns(run):
    assert run["header"] == overhead_timing.COLUMNS


def test_one_row_per_framework_case_and_scheme(run):
    keys = {(r["framework"], r["case"], r["spec"]) for r in run["rows"]}
    assert len(keys) == len(run["rows"])
    assert {(fw, case) for fw, case, _ in keys} == {(fw, "flat 2^10") for fw in usable_backends()}
    # "all" is every scheme but the adaptive auto (test_all_means_every_fixed_scheme)
    assert {spec for _, _, spec in keys} == {name for name in SCHEMES if not SCHEMES[name][1].adaptive}


def test_baselines_and_core_schemes_measured(run):
    for r in run["rows"]:
        if r["scheme"] in ("fp16", "none", "bf16", "topk", "topkc"):
            assert r["error"] == "", r
    for r in run["rows"]:
        if r["error"]:
            continue
        assert int(r["reps"]) == 2
        assert 0 < float(r["p10_ms"]) <= float(r["median_ms"]) <= float(r["p90_ms"])
        assert float(r["grad_gbps"]) == pytest.approx(int(r["numel"]) * 4 / float(r["median_ms"]) / 1e6, rel=1e-6)
        assert float(r["copy_gbps"]) > 0 and float(r["vs_fp16"]) > 0
        if r["scheme"] == "fp16":
            assert float(r["vs_fp16"]) == 1.0 and float(r["wire_vs_fp16"]) == 1.0
            # grad in (4d) + result out (4d) + fp16 payload out and in (2 * 2d) = 12 d bytes,
            # plus from 8 ranks on its agreed 0-d scale read and written (8 B, cast.py)
            assert int(r["floor_bytes"]) == 12 * int(r["numel"]) + (8 if int(r["world_size"]) >= 8 else 0)
            assert float(r["x_floor"]) == pytest.approx(
                float(r["median_ms"]) / (int(r["floor_bytes"]) / float(r["copy_gbps"]) / 1e6), rel=1e-6)
        if r["scheme"] == "none":
            assert int(r["floor_bytes"]) == 0 and r["x_floor"] == ""


def test_table_has_definitions_and_ratios(run):
    text = run["text"]
    assert "COLLECTIVE EXCLUDED" in text and "vs fp16 = FP16 median / ours" in text
    assert "1.00x" in text and "copy bandwidth" in text


@pytest.mark.parametrize("backend", BACKENDS)
def test_floor_bytes_hand_cases(backend):
    ops = overhead_timing.no_collective(backend_ops(backend))
    like = ops.zeros((4,), "float32", None)
    d = 1024
    info = TensorInfo("t", (d,), "float32", 8, 0)
    topk = make_scheme("topk")
    # residual state 4d read + written, dense float32 payload 4d written + read: 2*4d * 3 = 24 d.
    assert overhead_timing.floor_bytes(topk, info, ops, topk.init(ops, info, like)) == 24 * d
    topkc = make_scheme("topkc", chunk=256, ratio=0.01)
    # m = 4 chunks, k = 1: payload 256 values + 4 scores + 16 vote slots in fp16 = 552 B, no
    # side collective; state: residual 4d + agreed scores 4 float32 = 16 B + realigned int64.
    expected = 2 * 4 * d + 2 * (4 * d + 16 + 8) + 2 * 552
    assert overhead_timing.floor_bytes(topkc, info, ops, topkc.init(ops, info, like)) == expected
    current = make_scheme("topkc", chunk=256, ratio=0.01, selection="current")
    # The blocking variant: payload 512 B; side 4 float32 = 16 B; residual 4d, no scores.
    expected = 2 * 4 * d + 2 * (4 * d + 8) + 2 * 512 + 2 * 16
    assert overhead_timing.floor_bytes(current, info, ops, current.init(ops, info, like)) == expected
    # Below min_numel (1024 for topkc) the routing sends the tensor as fp16 (no state): 12 d.
    small = TensorInfo("b", (1000,), "float32", 8, 0)
    fp16 = Routing.single(topkc).decide(None, 1000).scheme
    assert fp16.name == "fp16"
    # (8 ranks: fp16's agreed 0-d scale read and written, 8 B)
    assert overhead_timing.floor_bytes(fp16, small, ops, fp16.init(ops, small, like)) == 2 * 4000 + 2 * 2000 + 8


def test_no_collective_is_identity():
    ops = overhead_timing.no_collective(backend_ops(BACKENDS[0]))
    x = ops.zeros((3,), "float32", None)
    assert ops.allreduce(x, "sum", "name") is x


def test_all_means_every_fixed_scheme():
    specs = [spec for spec, _ in overhead._build_schemes("all")]
    assert specs[0] == "fp16" and "auto" not in specs
    assert set(specs) == {name for name, (_, cls) in SCHEMES.items() if not cls.adaptive}


def test_model_inputs_for_a_tiny_reference(monkeypatch):
    monkeypatch.setitem(model.REFERENCE_MODELS, "tiny", {
        "shapes": [(64, 32), (64,), (64, 32)], "compute_s": 0.05, "note": "two matrices and a bias"})
    runner = overhead_timing.make_runner(BACKENDS[0], "cpu", type("A", (), {"threads": 0, "tf_inner": 1, "clock": "host"})())
    schemes = overhead._build_schemes("topkc topkc:selection=current")
    data = overhead.model_inputs(runner, schemes, "tiny", world_size=8, warmup=1, reps=1, min_reps=1,
                                 budget=0, copy_gbps=10.0, worker_counts=(8, 16),
                                 target_copy_gbps=1000.0)
    assert data["meta"]["codec_scale"] == pytest.approx(0.01) and data["meta"]["tensors"] == 3
    assert data["meta"]["errors"] == {}
    topkc = data["compressors"]["topkc"]
    info = TensorInfo("t", (64, 32), "float32", 8, 0)
    wire = make_scheme("topkc").wire(info)
    bias = make_scheme("fp16").wire(TensorInfo("b", (64,), "float32", 8, 0))
    # 2048 coordinates: 8 chunks of 256, k = 1, scores and 16 vote slots ride in the payload;
    # the 64-bias is below min_numel: the routing sends it as fp16, as in training (topkc
    # itself would send 2 * (256 + 1 + 16) bytes).
    assert wire == (2 * (256 + 8 + 16), 0, 0) and bias == (2 * 64, 0, 0)
    assert make_scheme("topkc").wire(TensorInfo("b", (64,), "float32", 8, 0)).payload == 2 * (256 + 1 + 16)
    assert topkc["payload_bytes"] == 2 * wire.payload + bias.payload
    assert topkc["side_bytes"] == 0 and topkc["side_collectives"] == 0
    # The blocking variant: one side all-reduce (8 float32 scores) per compressed matrix.
    current = data["compressors"]["topkc:selection=current"]
    assert current["payload_bytes"] == 2 * 2 * 256 + bias.payload
    assert current["side_bytes"] == 2 * 4 * 8 and current["side_collectives"] == 2
    assert topkc["payload_bytes_by_workers"]["16"] == topkc["payload_bytes"]
    assert 0 < topkc["codec_fixed_s"] <= topkc["codec_s"] and topkc["compute_s"] == 0.05
    # The entry round-trips through JSON and the model's reader.
    m = model._measurement("topkc", json.loads(json.dumps(topkc)))
    assert m.payload_at(8) == topkc["payload_bytes"] and not math.isinf(m.payload_at(16))


def test_specs_are_compressors_routed_per_tensor():
    """A spec is a compressor spec (min_numel accepted); each tensor is timed with the scheme
    its routing picks: a 64-coordinate bias under thc as fp16, as in training."""
    schemes = overhead._build_schemes("thc thc:min_numel=32")
    assert [(spec, r.min_numel) for spec, r in schemes] == [("fp16", 1), ("thc", 1024), ("thc:min_numel=32", 32)]
    runner = overhead_timing.make_runner(BACKENDS[0], "cpu", type("A", (), {"threads": 0, "tf_inner": 1, "clock": "host"})())
    rows = overhead_timing.measure(runner, schemes, "bias 64", (64,), world_size=8, warmup=0, reps=1, min_reps=1,
                            budget=0)
    by = {r["spec"]: r for r in rows}
    assert all(r["error"] == "" and r["reps"] == 1 for r in rows), rows
    # thc's routing: fp16, 2 bytes per coordinate, its 0-d scale at 8 ranks (floor 12 d + 8, as
    # the fp16 row).
    assert by["thc"]["scheme"] == "thc" and by["thc"]["payload_bytes"] == 2 * 64
    assert by["thc"]["floor_bytes"] == by["fp16"]["floor_bytes"] == 12 * 64 + 8
    # With min_numel=32 the bias goes through THC: its int32 words.
    thc_wire = make_scheme("thc").wire(TensorInfo("b", (64,), "float32", 8, 0))
    assert by["thc:min_numel=32"]["payload_bytes"] == thc_wire.payload != 2 * 64


@pytest.mark.parametrize("backend", BACKENDS)
def test_timed_call_is_one_training_step(backend):
    """Each timed call is compress + finish on the state the previous call left (error feedback
    and TopKC's agreed scores move on): the outputs equal scheme_steps' over the same steps."""
    import numpy as np
    from tests.backends import scheme_steps
    runner = overhead_timing.make_runner(backend, "cpu", type("A", (), {"threads": 0, "tf_inner": 1, "clock": "host"})())
    gen = np.random.default_rng(5)
    array = (gen.standard_normal(4096) * np.repeat(gen.uniform(0.1, 2.0, 16), 256)).astype(np.float32)
    grad = runner.tensor(array)
    for spec in ("topkc:ratio=0.1", "topkc:ratio=0.1,selection=current", "topk:ratio=0.05"):
        name, options = parse_spec(spec)
        scheme = make_scheme(name, **options)
        info = TensorInfo("bench.t", (4096,), "float32", 8, 0)
        call, _ = runner.prepare(scheme, info, grad)
        got = [np.asarray(call()) for _ in range(4)]
        expected = [np.asarray(s["out"]) for s in scheme_steps(runner.ops, scheme, [grad] * 4, info)]
        for step, (a, b) in enumerate(zip(got, expected)):
            # TensorFlow runs the call as one graph, which may round differently from eager ops.
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max(), err_msg=f"{spec} step {step}")
        assert not all(np.array_equal(got[0], g) for g in got[1:]), spec  # the state moved on


@pytest.mark.skipif("torch" not in BACKENDS, reason="torch backend not under test")
def test_ddp_hook_rows_time_pytorchs_own_hooks():
    """DDP's fp16 and PowerSGD hooks run inside a one-rank DDP backward on the same tensor as
    the schemes, in the same rounds; their rows carry the hook's wire bytes and a time."""
    import torch.distributed as dist
    runner = overhead_timing.make_runner("torch", "cpu", type("A", (), {"threads": 0, "tf_inner": 1, "clock": "host"})())
    try:
        rows = overhead_timing.measure(runner, overhead._build_schemes("powersgd:rank=2"), "m", (64, 48),
                                world_size=8, warmup=1, reps=3, min_reps=3, budget=0,
                                ddp_hooks=("fp16", "powersgd:rank=2"))
        flat = overhead_timing.measure(runner, overhead._build_schemes(""), "v", (300,), world_size=8,
                                warmup=1, reps=2, min_reps=2, budget=0, ddp_hooks=("powersgd:rank=2",))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    by_spec = {r["spec"]: r for r in rows}
    assert set(by_spec) == {"fp16", "powersgd:rank=2", "ddp fp16", "ddp powersgd:rank=2"}
    assert all(not r["error"] and r["reps"] == 3 and r["median_ms"] > 0 for r in rows), rows
    assert by_spec["ddp fp16"]["payload_bytes"] == 2 * 64 * 48
    assert by_spec["ddp powersgd:rank=2"]["payload_bytes"] == 4 * 2 * (64 + 48)
    assert by_spec["ddp fp16"]["vs_fp16"] == pytest.approx(by_spec["fp16"]["median_ms"]
                                                           / by_spec["ddp fp16"]["median_ms"])
    # A vector: PowerSGD's hook all-reduces it uncompressed, 4 bytes a coordinate.
    assert {r["spec"]: r["payload_bytes"] for r in flat} == {"fp16": 600, "ddp powersgd:rank=2": 1200}
    with pytest.raises(ValueError, match="fp16 or powersgd"):
        overhead_timing.DDPHook("topk", runner.tensor(__import__("numpy").zeros(4, "float32")), 8)


def test_whole_model_table_sums_a_step():
    data = {"meta": {"reference": "r", "tensors": 2, "parameters": 1000, "codec_measured_on": "x"},
            "compressors": {"fp16": {"codec_s": 0.002, "payload_bytes": 2000, "side_bytes": 0,
                                     "side_collectives": 0},
                            "thc": {"codec_s": 0.010, "payload_bytes": 700, "side_bytes": 8,
                                    "side_collectives": 1}}}
    lines = overhead.whole_model_table(data).splitlines()
    assert "2 tensors" in lines[0] and "1,000 parameters" in lines[0]
    assert lines[1].split()[:3] == ["fp16", "2.0", "ms"] and "1.00x" in lines[1]
    assert lines[2].split()[:4] == ["thc", "10.0", "ms", "5.00x"] and "708 B" in lines[2]
