"""One tiny lm-comm sweep end to end (issues 25 and 34): 2 workers, a few steps, six rows:
FP16, TopKC under Adam with another learning rate (a row naming its optimizer), a row whose
optimizer options are rejected (it fails alone; the sweep goes on), FP16 with gradient
accumulation over 2 micro-batches, TopKC as compressed update sync every step, and FP16 update
sync every 2 steps (local steps).

Checks the FP16-relative target and the stop flags given to the rows after FP16 (the target,
the time cap, FP16's schedule length), the users' recipe in the runs' records, the ``steps to
target`` column, the optimizer probe's records (adam.csv, adam_ratios.md) and the tta-adam
block written into a doc.
"""
import csv
import json
import sys

import pytest

from hvd_gradcomp.bench import report
from tests.hvdrun import ROOT, run_process

STEPS = 6


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("adam")
    (out / "doc.md").write_text("intro\n<!-- tta-adam:start -->\n<!-- tta-adam:end -->\n")
    cmd = [sys.executable, "-m", "hvd_gradcomp.bench", "tta", "--workloads", "lm-comm", "--compressors",
           "fp16; topkc:ratio=0.1 with adam(lr=6.3e-3); fp16 with adamw(nosuch=1); fp16 with accumulate(2); "
           "topkc:ratio=0.1 with update-sync(every=1); fp16 with update-sync(every=2)",
           "--bandwidth", "200", "--out", str(out), "--no-progress", "--skip-link-check",
           "--update-doc", str(out / "doc.md"), "--doc-block", "tta-adam",
           "--worker-args", f"--max-steps {STEPS} --eval-every 2 --adam-log-every 3 --batch-size 4"]
    res = run_process(cmd, timeout=600)
    return out, res


def test_rows_run_and_the_bad_optimizer_fails_alone(sweep):
    out, res = sweep
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]  # one row failed
    with open(out / "runs.csv") as f:
        runs = {r["label"]: r for r in csv.DictReader(f)}
    assert list(runs) == ["fp16", "topkc:ratio=0.1 with adam(lr=6.3e-3)", "fp16 with adamw(nosuch=1)",
                          "fp16 with accumulate(2)", "topkc:ratio=0.1 with update-sync(every=1)",
                          "fp16 with update-sync(every=2)"]
    for label in list(runs)[3:]:
        assert runs[label]["status"] == "ok", label
        assert 0 < int(runs[label]["steps"]) <= STEPS and float(runs[label]["target"]) == float(runs["fp16"]["target"])
    assert runs["fp16 with accumulate(2)"]["accumulate"] == "2"
    assert runs["fp16 with update-sync(every=2)"]["update_sync"] == "every=2"
    # bytes per optimizer step: update sync every 2 steps sends half FP16's bytes
    assert float(runs["fp16 with update-sync(every=2)"]["fp16_bytes_ratio"]) == pytest.approx(2.0, rel=0.01)
    bad = runs["fp16 with adamw(nosuch=1)"]
    assert bad["status"].startswith("failed") and bad["optimizer"] == "adamw(nosuch=1)"
    assert "optimizer adamw: torch.optim.AdamW(" in res.stderr and "rejected its options" in res.stderr
    fp16, topkc = runs["fp16"], runs["topkc:ratio=0.1 with adam(lr=6.3e-3)"]
    assert fp16["status"] == topkc["status"] == "ok" and fp16["optimizer"] == ""
    assert int(fp16["steps"]) == int(topkc["steps"]) == STEPS and int(fp16["params"]) == 470528
    # The target: 1.02 x FP16's final rolling perplexity, which FP16 itself reaches.
    assert float(fp16["target"]) == pytest.approx(1.02 * float(fp16["final_metric"]))
    assert float(topkc["target"]) == float(fp16["target"]) and float(fp16["target_vs_fp16"]) == 1.02
    assert 0 < int(fp16["steps_to_target"]) <= STEPS and float(fp16["steps_vs_fp16"]) == 1.0
    assert float(fp16["step_time_vs_fp16"]) == 1.0 and float(topkc["step_time_vs_fp16"]) > 0
    assert "steps to target  FP16 step/ours" in res.stdout


def test_rows_after_fp16_get_its_target_and_the_optimizer(sweep):
    out, _ = sweep
    data = json.loads((out / "results.json").read_text())
    results = {r["meta"]["label"]: r for r in data["results"].values()}
    fp16, topkc = results["fp16"], results["topkc:ratio=0.1 with adam(lr=6.3e-3)"]
    # the users' recipe: AdamW (0.9, 0.95) with its schedule; a row naming Adam gets Adam, and the schedule
    assert fp16["meta"]["optimizer_class"] == "AdamW" and topkc["meta"]["optimizer_class"] == "Adam"
    assert fp16["meta"]["optimizer_options"]["betas"] == [0.9, 0.95] and fp16["meta"]["recipe"] == "adamw-cosine"
    assert fp16["meta"]["schedule_steps"] == STEPS and topkc["meta"]["schedule_steps"] == STEPS  # FP16's steps
    final = report.rolling_mean(fp16["evals"]["metric"], fp16["meta"]["window"])[-1]
    assert topkc["meta"]["target"] == pytest.approx(1.02 * final, rel=1e-5)  # the stop flags
    assert fp16["meta"]["target"] is None and fp16["meta"]["stop_reason"] == "max_steps"
    command = (out / "logs" / "lm-comm-horovod-topkc-ratio-0-1-with-adam-lr-6-3e-3" / "command.txt").read_text()
    assert "--optimizer adam(lr=6.3e-3)" in command and "--epochs-past-target 0 --max-seconds " in command
    cap = topkc["meta"]["stop_cap"]
    assert cap["cap"] == 1.5 and cap["max_seconds"] == pytest.approx(1.5 * cap["fp16_tta_s"])
    assert f"--max-seconds {cap['max_seconds']:.6g}" in command and f"--schedule-steps {STEPS}" in command
    sync = results["topkc:ratio=0.1 with update-sync(every=1)"]
    assert sync["meta"]["update_sync"] == "every=1" and sync["bytes_per_step"]["every"] == 1


def test_adam_records_csv_ratios_and_block(sweep):
    out, _ = sweep
    data = json.loads((out / "results.json").read_text())
    logged = {}
    for res in data["results"].values():
        if res.get("status") != "ok":
            continue
        adam = res["adam"]
        # accumulate(2) steps the optimizer at micro-batches 2, 4, 6: only 6 ends a window of 3
        expect = [6] if res["meta"]["accumulate"] == 2 else [3, 6]
        if res["meta"].get("stop_reason") != "max_steps":
            # a row after FP16 that stopped at its target or at the time cap (which follows the
            # machine's load) logged a prefix of the windows
            expect = expect[:len(adam["steps"])] or [None]
        assert adam["steps"] == expect and adam["every"] == 3 and len(adam["tensors"]) == 29
        for t in adam["tensors"].values():
            assert all(v > 0 for v in t["update_rms"] + t["v_mean"] + t["grad_rms"])
        logged[res["meta"]["label"]] = len(expect)
    with open(out / "adam.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == sum(logged.values()) * 29 and set(rows[0]) == set(report.ADAM_COLUMNS)
    ratios = (out / "adam_ratios.md").read_text().splitlines()
    assert ratios[0].startswith("| run | step | v ours/FP16 |")
    assert len(ratios) == 2 + sum(n for label, n in logged.items() if label != "fp16")
    block = (out / "doc.md").read_text()
    assert "every row after FP16 stopped at the target or when its training clock passed 1.5 x FP16's TTA" in block
    assert "| lm-comm | topkc:ratio=0.1 with adam(lr=6.3e-3) |" in block and "steps to target" in block
    assert "(1.02 x FP16's final rolling metric in this sweep)" in block
