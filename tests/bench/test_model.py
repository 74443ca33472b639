"""The scale model's arithmetic against hand-computed cases, its inputs, and its command.

Every expected number below is worked out by hand in the comment next to it.
"""
import csv
import json
import math
import os

import pytest

from hvd_gradcomp.bench import model, model_projection
from hvd_gradcomp.bench.model import (Measurement, Network, allreduce_time, latency, load_inputs,
                                      predict_step_time, tta_ratio, winning_ranges)
from tests.conftest import ROOT

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # matplotlib's pyparsing use

NO_LATENCY = Network(alpha_s=0.0, hop_s=0.0, hops="none")


def test_latency_hops():
    net = Network(alpha_s=0.5e-3, hop_s=5e-6, hops="tree")
    # tree, N=8: 2 * ceil(log2 8) = 6 hops -> 0.5 ms + 30 us.
    assert latency(8, net) == pytest.approx(0.53e-3)
    # tree, N=5: ceil(log2 5) = 3 -> 6 hops, same as N=8.
    assert latency(5, net) == pytest.approx(0.53e-3)
    # ring, N=8: 2 * 7 = 14 hops -> 0.5 ms + 70 us.
    assert latency(8, net._replace(hops="ring")) == pytest.approx(0.57e-3)
    # none: the plain alpha of "alpha + 2(N-1)/N b/B".
    assert latency(4096, net._replace(hops="none")) == pytest.approx(0.5e-3)
    # One worker: no collective at all.
    assert latency(1, net) == 0.0


def test_allreduce_time_ring_formula():
    net = Network(alpha_s=1e-3, hop_s=0.0, hops="none")
    # 1e8 bytes, N=4, 10 Gbit/s = 1.25e9 B/s: 1 ms + 2*3/4 * 1e8/1.25e9 = 0.001 + 0.12 = 0.121 s.
    assert allreduce_time(1e8, 4, 10, net) == pytest.approx(0.121)
    # Three collectives of the same total: the latency counts three times.
    assert allreduce_time(1e8, 4, 10, net, collectives=3) == pytest.approx(0.123)
    assert allreduce_time(1e8, 1, 10, net) == 0.0
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        allreduce_time(1.0, 4, 0, net)


def test_predict_step_time_hand_case():
    m = Measurement(compute_s=0.2, codec_s=0.05, payload_bytes=150e6, side_bytes=4000,
                    side_collectives=10)
    net = Network(alpha_s=1e-3, hop_s=0.0, hops="none", fusion_bytes=64 * 2 ** 20)
    st = predict_step_time(m, 16, 25, net)
    # 25 Gbit/s = 3.125e9 B/s; 2 (N-1)/N = 1.875 for N=16.
    # payload: ceil(150e6 / 64 MiB) = 3 fused collectives -> 3 ms + 1.875 * 150e6 / 3.125e9 = 0.093 s.
    assert st.payload == pytest.approx(0.093)
    # side: 10 collectives -> 10 ms + 1.875 * 4000 / 3.125e9 = 0.0100024 s.
    assert st.side == pytest.approx(0.0100024)
    # total: 0.2 + 0.05 + 0.0100024 + 0.093.
    assert st.total == pytest.approx(0.3530024)
    # overlap 0.25 hides 0.05 s of the payload: exposed 0.043, total 0.3030024.
    st = predict_step_time(m, 16, 25, net._replace(overlap=0.25))
    assert st.payload == pytest.approx(0.043) and st.total == pytest.approx(0.3030024)
    # overlap 1 hides all of it (0.093 < 0.2): payload term 0.
    assert predict_step_time(m, 16, 25, net._replace(overlap=1.0)).payload == 0.0
    # codec_scale 0.1 with codec_fixed_s 0.01: 0.01 + (0.05 - 0.01) * 0.1 = 0.014.
    st = predict_step_time(m._replace(codec_fixed_s=0.01), 16, 25, net, codec_scale=0.1)
    assert st.codec == pytest.approx(0.014)


def test_tta_ratio_and_crossover_hand_case():
    # N=2 (2(N-1)/N = 1), 8 Gbit/s = 1e9 B/s, no latency.
    fp16 = Measurement(compute_s=0.1, codec_s=0.01, payload_bytes=1e8, steps_to_target=1000)
    ours = Measurement(compute_s=0.1, codec_s=0.03, payload_bytes=1e7, steps_to_target=1200)
    # fp16 step: 0.1 + 0.01 + 0.1 = 0.21; ours: 0.1 + 0.03 + 0.01 = 0.14.
    # ratio = (1000 * 0.21) / (1200 * 0.14) = 210 / 168 = 1.25.
    assert tta_ratio(ours, fp16, 2, 8, NO_LATENCY) == pytest.approx(1.25)
    # Without steps on one side: step-time ratio only, 0.21 / 0.14 = 1.5.
    assert tta_ratio(ours._replace(steps_to_target=None), fp16, 2, 8, NO_LATENCY) == pytest.approx(1.5)
    # Crossover: 1000 (0.11 + 1e8/B) = 1200 (0.13 + 1e7/B)  =>  8.8e10 / B = 46
    # => B = 1.9130e9 B/s = 15.304 Gbit/s; ours wins below it.
    ranges = winning_ranges(ours, fp16, 2, 1.0, 100.0, NO_LATENCY)
    assert len(ranges) == 1
    start, end = ranges[0]
    assert start == pytest.approx(1.0)
    assert end == pytest.approx(8 * 8.8e10 / 46 / 1e9, rel=2e-3)
    # FP16 against itself never wins strictly.
    assert winning_ranges(fp16, fp16, 2, 1.0, 100.0, NO_LATENCY) == []


def test_auto_choice_takes_the_best_candidate_past_the_hysteresis():
    # Payload term only: 2 (N-1)/N * b / B; N = 2, 10 Gbit/s = 1.25e9 B/s, compute 0.1 s.
    fp16 = Measurement(0.1, 0.0, 1e8)  # 0.1 + 0.08 = 0.18 s
    inputs = {"fp16": fp16,
              "thc": Measurement(0.1, 0.01, 2.5e7),  # 0.1 + 0.01 + 0.02 = 0.13 s: ratio 1.385
              "topkc": Measurement(0.1, 0.0, 1e7, side_collectives=161),  # blocking: never a candidate
              "topk": Measurement(0.1, 0.0, 1e6)}  # not among auto's candidates
    choice, ratio = model_projection.auto_choice(inputs, 2, 10, NO_LATENCY)
    assert choice == "thc" and ratio == pytest.approx(0.18 / 0.13)
    # A gain below the hysteresis (10 %: ratio < 1.111) keeps fp16.
    inputs["thc"] = Measurement(0.1, 0.05, 2.5e7)  # 0.17 s: ratio 1.059
    assert model_projection.auto_choice(inputs, 2, 10, NO_LATENCY) == ("fp16", 1.0)
    assert model_projection.auto_choice(inputs, 2, 10, NO_LATENCY, hysteresis=0.0)[0] == "thc"


def test_side_collective_latency_can_lose_at_scale():
    # Same bytes, but 100 synchronous side collectives with ring latency 1 us per hop:
    # at N=8: 100 * 14 us = 1.4 ms; at N=4096: 100 * 8190 us = 0.819 s.
    net = Network(alpha_s=0.0, hop_s=1e-6, hops="ring")
    fp16 = Measurement(0.1, 0.0, 1e8)
    ours = Measurement(0.1, 0.0, 1e7, side_bytes=0, side_collectives=100)
    assert predict_step_time(ours, 8, 8, net).side == pytest.approx(100 * 14e-6)
    assert predict_step_time(ours, 4096, 8, net).side == pytest.approx(100 * 8190e-6)
    assert tta_ratio(ours, fp16, 8, 8, net) > 1 > tta_ratio(ours, fp16, 4096, 8, net)


def test_world_size_dependent_wire_and_not_runnable():
    m = Measurement(0.1, 0.0, 999.0, payload_bytes_by_workers={8: 100.0, 64: 200.0, 2048: None})
    assert m.payload_at(8) == 100.0 and m.payload_at(32) == 100.0 and m.payload_at(64) == 200.0
    assert m.payload_at(4) == 100.0  # below the table: its smallest N
    assert math.isinf(predict_step_time(m, 4096, 10).total)
    assert tta_ratio(m, Measurement(0.1, 0.0, 1e8), 4096, 10) == 0.0


def test_network_checks():
    with pytest.raises(ValueError, match="overlap must be in"):
        Network(overlap=1.5).check()
    with pytest.raises(ValueError, match="hops must be"):
        Network(hops="star").check()


def test_resnet50_reference_shapes():
    shapes = model.REFERENCE_MODELS["resnet50"]["shapes"]
    assert len(shapes) == 161
    assert sum(math.prod(s) for s in shapes) == 25_557_032  # torchvision resnet50
    # From package data, in torchvision's parameter order: conv1, bn1, then layer1's first block.
    assert shapes[:6] == [(64, 3, 7, 7), (64,), (64,), (64, 64, 1, 1), (64,), (64,)]
    assert shapes[-2:] == [(1000, 2048), (1000,)]


def test_load_shapes_checks_its_own_counts(tmp_path):
    good = tmp_path / "m.json"
    good.write_text(json.dumps({"model": "m", "tensors": 2, "parameters": 13, "shapes": [[3, 4], [1]]}))
    assert model.load_shapes(str(good)) == [(3, 4), (1,)]
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"model": "m", "tensors": 2, "parameters": 14, "shapes": [[3, 4], [1]]}))
    with pytest.raises(ValueError, match="2 shapes with 13 parameters, but the file states 2 and 14"):
        model.load_shapes(str(bad))
    bad.write_text(json.dumps({"model": "m", "tensors": 1, "parameters": 0, "shapes": [[0]]}))
    with pytest.raises(ValueError, match="every dimension must be an integer >= 1"):
        model.load_shapes(str(bad))


def _entry(**kw):
    base = dict(compute_s=0.1, codec_s=0.01, payload_bytes=5e7, side_bytes=0, side_collectives=0,
                steps_to_target=None)
    base.update(kw)
    return base


def test_load_inputs_forms(tmp_path):
    wrapped = tmp_path / "a.json"
    wrapped.write_text(json.dumps({"meta": {"codec_scale": 0.5},
                                   "compressors": {"fp16": _entry(), "topkc": _entry(payload_bytes=1e6)}}))
    inputs, meta = load_inputs(str(wrapped))
    assert meta["codec_scale"] == 0.5 and inputs["topkc"].payload_bytes == 1e6
    bare = tmp_path / "b.json"
    bare.write_text(json.dumps({"fp16": _entry(), "thc": _entry(side_collectives=3)}))
    inputs, _ = load_inputs(str(bare))
    assert inputs["thc"].side_collectives == 3 and isinstance(inputs["thc"].side_collectives, int)
    table = tmp_path / "c.csv"
    with open(table, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["compressor"] + list(_entry()))
        w.writeheader()
        w.writerow({"compressor": "fp16", **_entry(steps_to_target="")})
        w.writerow({"compressor": "powersgd", **_entry(steps_to_target=900)})
    inputs, _ = load_inputs(str(table))
    assert inputs["fp16"].steps_to_target is None and inputs["powersgd"].steps_to_target == 900
    missing = tmp_path / "d.json"
    missing.write_text(json.dumps({"topkc": _entry()}))
    with pytest.raises(ValueError, match="need an 'fp16' entry"):
        load_inputs(str(missing))
    bad = tmp_path / "e.json"
    bad.write_text(json.dumps({"fp16": {"compute_s": 0.1}}))
    with pytest.raises(ValueError, match="lacks"):
        load_inputs(str(bad))


def test_default_inputs_load():
    inputs, meta = load_inputs(model.DEFAULT_INPUTS)
    assert "fp16" in inputs and len(inputs) >= 4
    assert meta["reference"] == "resnet50" and 0 < meta["codec_scale"] < 1


def test_command_writes_table_csv_and_heatmap(tmp_path, capsys):
    inputs = tmp_path / "in.json"
    inputs.write_text(json.dumps({"fp16": _entry(), "small": _entry(codec_s=0.02, payload_bytes=1e6,
                                                                      side_collectives=20)}))
    out = tmp_path / "out"
    assert model_projection.main(["--inputs", str(inputs), "--workers", "8,64", "--gbps", "10,100",
                       "--out", str(out)]) == 0
    text = (out / "model.txt").read_text()
    assert "small: TTA ratio vs FP16" in text and "beats FP16" in text
    with open(out / "model.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 2 + 2 * 2  # each compressor's cells, then auto's
    assert [r["choice"] for r in rows if r["compressor"] == "auto"] == ["fp16"] * 4  # "small" is not a candidate
    assert {"compressor", "workers", "gbps", "step_s", "tta_vs_fp16"} <= set(rows[0])
    assert os.path.getsize(out / "model_heatmap.png") > 1000


def test_check_against_a_run_record():
    # 100 steps in 50 s -> 0.5 s per step; compute 60% = 0.3 s, codec 10% = 0.05 s.
    # 800 Mbit/s = 1e8 B/s, N=2: 2(N-1)/N = 1, payload 1e7 B -> 0.1 s; no latency.
    # Predicted 0.3 + 0.05 + 0.1 = 0.45 s against a measured median of 0.5 s: -10%.
    row = {"run_id": "r1", "spec": "topkc", "status": "ok", "steps": 100, "clock_s": 50.0,
           "compute_share": 0.6, "codec_share": 0.1, "bytes_payload": 1e7, "bytes_side": 0,
           "side_collectives": 0, "world_size": 2, "bandwidth_mbit": 800, "latency_ms": 0,
           "step_ms_median": 500.0}
    m, workers, gbps, lat = model.measurement_from_run(row)
    assert (m.compute_s, m.codec_s, workers, gbps, lat) == pytest.approx((0.3, 0.05, 2, 0.8, 0.0))
    (res,) = model.check_against_runs([row, dict(row, bandwidth_mbit=None), dict(row, status="failed")],
                                      NO_LATENCY)
    assert res["predicted_s"] == pytest.approx(0.45) and res["rel_error"] == pytest.approx(-0.1)
    # A 2 ms link latency on a ring of 2 (2 hops) adds 4 ms to the one fused collective.
    (res,) = model.check_against_runs([dict(row, latency_ms=2)], Network(0.0, 0.0, "ring"))
    assert res["predicted_s"] == pytest.approx(0.454)


def test_model_against_the_committed_bandwidth_limited_runs():
    """The scale model's step time against the real 500 Mbit/s runs of docs/tta-demo.

    Stated error: within 45% for every Horovod run, and never above the measurement by more
    than 10% (the model leaves out Horovod's negotiation cycle and the CPU cost of summing
    fp16 in Gloo, so it under-predicts: FP16 itself by 40-41% in the 500 Mbit/s and 1 Gbit/s
    sweeps of 2026-11-30). DDP PowerSGD is excluded: the harness counts its asynchronous half
    as communication, which the model does not see as codec time. So are the blocking
    two-round variants: the committed run timed their side all-reduce as codec (fixed in the
    harness after that run), which the model then counts twice.
    """
    path = os.path.join(ROOT, "docs", "tta-demo", "runs.csv")
    if not os.path.exists(path):
        pytest.skip("no committed TTA demo run")
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["system"] == "horovod"
                and not any(v in r["spec"] for v in ("selection=current", "range=current", "two_round"))]
    checks = model.check_against_runs(rows)
    assert len(checks) >= 4
    for c in checks:
        assert -0.45 <= c["rel_error"] <= 0.10, c


def test_check_command_prints_the_comparison(tmp_path, capsys):
    row = {"run_id": "r1", "spec": "topkc", "status": "ok", "steps": 100, "clock_s": 50.0,
           "compute_share": 0.6, "codec_share": 0.1, "bytes_payload": 1e7, "bytes_side": 0,
           "side_collectives": 0, "world_size": 2, "bandwidth_mbit": 800, "latency_ms": 0,
           "step_ms_median": 500.0}
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(row))
        w.writeheader()
        w.writerow(row)
    assert model_projection.main(["--check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "topkc" in out and "500.0" in out
