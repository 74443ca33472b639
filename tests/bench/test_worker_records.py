"""The time-to-accuracy worker's records (no training here): the rolling mean and
time-to-target, the Recorder's stop rule, caps, JSON and start-up time, and the compressor
timing proxy (the harness's side: test_tta.py).
"""
import json
import time
import types

import pytest

from hvd_gradcomp.bench import report
from hvd_gradcomp.bench.worker import Recorder, TimedCompressor, rolling_mean


# ---- rolling mean, time-to-target, stop rule ----

def test_rolling_mean_is_trailing():
    assert rolling_mean([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    assert rolling_mean([], 3) == []


def test_time_to_target_accuracy_and_perplexity():
    t = [0, 1, 2, 3, 4, 5]
    acc = [0.1, 0.9, 0.94, 0.97, 0.97, 0.98]
    assert report.time_to_target(t, acc, 0.96, True, window=1) == 3
    assert report.time_to_target(t, acc, 0.96, True, window=2) == 4  # (0.97 + 0.97) / 2
    assert report.time_to_target(t, acc, 0.99, True, window=1) is None
    ppl = [200, 20, 12, 10, 9, 9]
    assert report.time_to_target(t, ppl, 10.5, False, window=1) == 3
    assert report.time_to_target(t, ppl, 10.5, False, window=3) == 4  # (12 + 10 + 9) / 3 > 10.5
    with pytest.raises(ValueError, match="equal length"):
        report.time_to_target([0, 1], [0.5], 0.9)
    with pytest.raises(ValueError, match="window must be >= 1"):
        report.time_to_target([0], [0.5], 0.9, window=0)


def _args(**kw):
    base = dict(compression="fp16", seed=0, batch_size=8, lr=0.1, target=0.9, eval_every=2,
                window=1, epochs_past_target=1.0, max_epochs=10, max_seconds=0.0, max_steps=0,
                out=None, progress=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_recorder_stops_one_epoch_past_target():
    rec = Recorder(_args(), 0, 2, steps_per_epoch=4, higher_is_better=True, meta={})
    metrics = iter([0.5, 0.95, 0.95, 0.95, 0.95])
    assert not rec.evaluate(0.1, 0.0)
    stops = []
    for _ in range(12):
        rec.step(0.01, 0.002, 0.005, 1.0)
        if rec.due():
            stops.append((rec.step_count, rec.evaluate(next(metrics), rec.clock)))
            if stops[-1][1]:
                break
    # target met at step 4 (epoch 1); one epoch later (step 8) the run stops
    assert stops == [(2, False), (4, False), (6, False), (8, True)]
    assert rec.stop_reason == "target+epochs"
    assert rec.clock == pytest.approx(8 * 0.017)
    assert rec.steps["epoch"][-1] == 2.0


def test_recorder_caps_and_divergence():
    rec = Recorder(_args(max_seconds=0.05), 0, 2, 4, True, {})
    rec.step(0.03, 0, 0.03, 1.0)
    rec.step(0.03, 0, -0.01, 1.0)  # a negative remainder is clamped to 0
    assert rec.steps["comm_s"][-1] == 0.0
    assert rec.evaluate(0.2, 0.06) and rec.stop_reason == "max_seconds"
    rec = Recorder(_args(max_steps=3), 0, 2, 4, False, {})
    assert rec.max_steps == 3
    assert rec.evaluate(float("nan"), 0) and rec.stop_reason == "diverged"


def test_recorder_writes_json(tmp_path):
    out = tmp_path / "r.json"
    rec = Recorder(_args(out=str(out)), 0, 2, 4, True, {"workload": "digits"})
    rec.evaluate(0.5, 0)
    rec.step(0.1, 0.01, 0.02, 2.0)
    rec.write({"payload": 10, "side": 2, "side_collectives": 1})
    data = json.loads(out.read_text())
    assert data["meta"]["workload"] == "digits" and data["meta"]["world_size"] == 2
    assert data["steps"]["t"] == [pytest.approx(0.13)] and data["evals"]["metric"] == [0.5]
    Recorder(_args(out=str(tmp_path / "other.json")), 1, 2, 4, True, {}).write()
    assert not (tmp_path / "other.json").exists()  # only rank 0 writes


# ---- timing proxy ----

def test_timed_compressor_separates_side_collectives():
    side = types.SimpleNamespace(allreduce=lambda x, **kw: (time.sleep(0.05), x)[1])

    class Inner:
        def compress(self, t):
            time.sleep(0.02)
            side.allreduce(t, name="scores")
            return t, None

        def decompress(self, p, ctx):
            time.sleep(0.01)
            return p

    timed = TimedCompressor(Inner(), side, "allreduce")
    side.allreduce(1)  # outside compress: not counted
    payload, ctx = timed.compress(3)
    assert timed.decompress(payload, ctx) == 3
    comp, decomp, side_s = timed.take()
    assert 0.015 < comp < 0.045 and 0.008 < decomp < 0.03 and 0.045 < side_s < 0.09
    assert timed.take() == (0.0, 0.0, 0.0)
    timed.close()
    assert side.allreduce(5) == 5 and side.allreduce.__name__ == "<lambda>"


def test_recorder_records_startup(tmp_path):
    out = tmp_path / "r.json"
    rec = Recorder(_args(out=str(out)), 0, 2, 4, True, {})
    assert rec.process_start <= time.time()
    before = time.time()
    rec.step(0.1, 0.0, 0.0, 1.0)
    rec.step(0.1, 0.0, 0.0, 1.0)  # only the first step's end counts
    rec.write()
    meta = json.loads(out.read_text())["meta"]
    assert before <= meta["first_step_end"] <= time.time()
    assert meta["startup_s"] == pytest.approx(meta["first_step_end"] - meta["process_start"])
    assert meta["startup_s"] > 0
