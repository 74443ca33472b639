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
from hvd_gradcomp.bench import model, overhead
from hvd_gradcomp.registry import SCHEMES, make_scheme
from tests.conftest import BACKENDS, backend_ops

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("overhead")
    argv = ["--frameworks", ",".join(BACKENDS), "--devices", "cpu", "--min-log2", "10",
            "--max-log2", "10", "--layers", "none", "--warmup", "1", "--reps", "2", "--min-reps", "2", "--budget", "0", "--threads", "0", "--malloc", "system",
            "--copy-mib", "8", "--out", str(out)]
    assert overhead.main(argv) == 0
    with open(out / "overhead.csv", newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)
    return {"header": header, "rows": rows, "text": (out / "overhead.txt").read_text()}


def test_csv_columns(run):
    assert run["header"] == overhead.COLUMNS


def test_one_row_per_framework_case_and_scheme(run):
    keys = {(r["framework"], r["case"], r["spec"]) for r in run["rows"]}
    assert len(keys) == len(run["rows"])
    assert {(fw, case) for fw, case, _ in keys} == {(fw, "flat 2^10") for fw in BACKENDS}
    assert {spec for _, _, spec in keys} == set(SCHEMES)


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
            # grad in (4d) + result out (4d) + fp16 payload out and in (2 * 2d) = 12 d bytes.
            assert int(r["floor_bytes"]) == 12 * int(r["numel"])
            assert float(r["x_floor"]) == pytest.approx(
                float(r["median_ms"]) / (12 * int(r["numel"]) / float(r["copy_gbps"]) / 1e6), rel=1e-6)
        if r["scheme"] == "none":
            assert int(r["floor_bytes"]) == 0 and r["x_floor"] == ""


def test_table_has_definitions_and_ratios(run):
    text = run["text"]
    assert "COLLECTIVE EXCLUDED" in text and "vs fp16 = FP16 median / ours" in text
    assert "1.00x" in text and "copy bandwidth" in text


@pytest.mark.parametrize("backend", BACKENDS)
def test_floor_bytes_hand_cases(backend):
    ops = overhead.no_collective(backend_ops(backend))
    like = ops.zeros((4,), "float32", None)
    d = 1024
    info = TensorInfo("t", (d,), "float32", 8, 0)
    topk = make_scheme("topk")
    # residual state 4d read + written, dense float32 payload 4d written + read: 2*4d * 3 = 24 d.
    assert overhead.floor_bytes(topk, info, ops, topk.init(ops, info, like)) == 24 * d
    topkc = make_scheme("topkc", chunk=256, ratio=0.01)
    # m = 4 chunks, k = 1: payload 256 fp16 = 512 B; side 4 float32 = 16 B; residual 4d.
    expected = 2 * 4 * d + 2 * 4 * d + 2 * 512 + 2 * 16
    assert overhead.floor_bytes(topkc, info, ops, topkc.init(ops, info, like)) == expected


def test_no_collective_is_identity():
    ops = overhead.no_collective(backend_ops(BACKENDS[0]))
    x = ops.zeros((3,), "float32", None)
    assert ops.allreduce(x, "sum", "name") is x


def test_model_inputs_for_a_tiny_reference(monkeypatch):
    monkeypatch.setitem(model.REFERENCE_MODELS, "tiny", {
        "shapes": [(64, 32), (64,), (64, 32)], "compute_s": 0.05, "note": "two matrices and a bias"})
    runner = overhead._runner(BACKENDS[0], "cpu", type("A", (), {"threads": 0, "tf_inner": 1})())
    schemes = overhead._build_schemes("topkc")
    data = overhead.model_inputs(runner, schemes, "tiny", world_size=8, warmup=1, reps=1, min_reps=1,
                                 budget=0, copy_gbps=10.0, worker_counts=(8, 16),
                                 target_copy_gbps=1000.0)
    assert data["meta"]["codec_scale"] == pytest.approx(0.01) and data["meta"]["tensors"] == 3
    topkc = data["compressors"]["topkc"]
    info = TensorInfo("t", (64, 32), "float32", 8, 0)
    wire = make_scheme("topkc").wire(info)
    bias = make_scheme("topkc").wire(TensorInfo("b", (64,), "float32", 8, 0))
    assert topkc["payload_bytes"] == 2 * wire.payload + bias.payload
    assert topkc["side_collectives"] == 3
    assert topkc["payload_bytes_by_workers"]["16"] == topkc["payload_bytes"]
    assert 0 < topkc["codec_fixed_s"] <= topkc["codec_s"] and topkc["compute_s"] == 0.05
    # The entry round-trips through JSON and the model's reader.
    m = model._measurement("topkc", json.loads(json.dumps(topkc)))
    assert m.payload_at(8) == topkc["payload_bytes"] and not math.isinf(m.payload_at(16))
