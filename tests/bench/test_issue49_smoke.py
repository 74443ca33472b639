"""Issue 49's rows end to end on the loopback (2 Horovod workers, a few steps; no emulated
link, so no timing is asserted, only the bookkeeping): an overlapped update sync in fragments
runs and records its wait per step (a part of comm), the delay(1) row runs on DDP or is
reported as not run with the reason, and a second sweep given the first as its reference
stops FP16 early and labels its TTA as the estimate."""
import csv
import json
import sys

import pytest

from tests.hvdrun import run_process

STEPS = 8
ROWS = "fp16; fp16 with update-sync(every=4,overlap=true,fragments=2); fp16 with delay(1)"


def _sweep(out, *extra):
    cmd = [sys.executable, "-m", "hvd_gradcomp.bench", "tta", "--workloads", "lm-comm", "--loopback",
           "--compressors", ROWS, "--out", str(out), "--no-progress", "--skip-link-check",
           "--worker-args", "--eval-every 2", "--budget-epochs", f"{(STEPS - 0.5) / 588:.6f}", *extra]
    return run_process(cmd, timeout=600)


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    first = tmp_path_factory.mktemp("i49")
    res = _sweep(first)
    second = tmp_path_factory.mktemp("i49slow")
    res2 = _sweep(second, "--fp16-reference", str(first / "results.json"), "--fp16-steps", "4")
    return first, res, second, res2


def _runs(out):
    with open(out / "runs.csv") as f:
        return {r["label"]: r for r in csv.DictReader(f)}


def test_overlapped_update_sync_records_its_wait(sweeps):
    first, res, _, _ = sweeps
    runs = _runs(first)
    sync = runs["fp16 with update-sync(every=4,overlap=true,fragments=2)"]
    assert runs["fp16"]["status"] == "ok" and sync["status"] == "ok", res.stderr[-3000:]
    assert sync["update_sync"] == "every=4,overlap=true,fragments=2"
    data = json.loads((first / "results.json").read_text())
    for rec in data["results"].values():
        if rec.get("status") != "ok":
            continue
        s = rec["steps"]
        assert len(s["wait_s"]) == len(s["comm_s"]) > 0
        assert all(w is not None and 0 <= w <= c for w, c in zip(s["wait_s"], s["comm_s"]))
    for label in ("fp16", "fp16 with update-sync(every=4,overlap=true,fragments=2)"):
        assert 0 <= float(runs[label]["wait_share"]) <= float(runs[label]["comm_share"])
    assert float(runs["fp16"]["wait_share"]) == pytest.approx(float(runs["fp16"]["comm_share"]))
    assert "  comm  wait" in res.stdout


def test_delay_row_runs_on_ddp(sweeps):
    first, res, _, _ = sweeps
    row = _runs(first)["fp16 with delay(1) on DDP"]
    assert row["system"] == "ddp" and row["delay"] == "1"
    assert row["status"] == "ok", res.stderr[-3000:]


def test_fp16_stopped_early_is_labelled_as_the_estimate(sweeps):
    first, _, second, res2 = sweeps
    ref, runs = _runs(first), _runs(second)
    fp16 = runs["fp16"]
    assert fp16["status"] == "ok" and int(fp16["steps"]) == 4, res2.stderr[-3000:]
    assert int(float(fp16["steps_to_target"])) == int(float(ref["fp16"]["steps_to_target"]))
    assert float(fp16["tta_s"]) == pytest.approx(
        float(ref["fp16"]["steps_to_target"]) * float(fp16["step_ms_median"]) / 1e3, rel=1e-6)
    assert float(runs["fp16 with update-sync(every=4,overlap=true,fragments=2)"]["target"]) == \
        pytest.approx(float(ref["fp16"]["target"]))
    assert " (est.)" in res2.stdout and "stopped after 4 steps" in res2.stdout
    command = (second / "logs" / "lm-comm-horovod-fp16" / "command.txt").read_text()
    assert f"--max-steps 4 --schedule-steps {ref['fp16']['steps']}" in command
