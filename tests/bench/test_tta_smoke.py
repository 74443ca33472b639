"""One tiny sweep end to end: ``python -m hvd_gradcomp.bench tta`` with 2 workers, FP16 and
TopKC and the no-communication reference (FP32 on loopback, on by default), each twice
(``--repeats 2``), a few steps of a narrow digits MLP, on the emulated network (loopback
without root).

Checks that every output exists and holds sane values, and that no namespace is left behind.
"""
import csv
import json
import math
import os
import re
import subprocess
import sys

import pytest

from hvd_gradcomp.bench import netem, report
from tests.hvdrun import ROOT, run_process

HIDDEN, STEPS = 128, 6


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("tta")
    (out / "doc.md").write_text("intro\n<!-- smoke:start -->\n<!-- smoke:end -->\n")
    cmd = [sys.executable, "-m", "hvd_gradcomp.bench", "tta", "--compressors", "fp16;topkc:ratio=0.1",
           "--ddp-hooks", "off", "--repeats", "2", "--workers", "2", "--bandwidth", "200", "--out", str(out), "--no-progress",
           "--update-doc", str(out / "doc.md"), "--doc-block", "smoke",
           "--worker-args", f"--max-steps {STEPS} --hidden {HIDDEN} --eval-every 3 --target 0.5"]
    res = run_process(cmd, timeout=600, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    return out, res


def test_exit_status_and_table(sweep):
    out, res = sweep
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "fp16" in res.stdout and "topkc:ratio=0.1" in res.stdout and "Network:" in res.stdout
    assert "no communication (reference: fp32, unthrottled)" in res.stdout
    assert "The no-communication row is a reference, not a competitor" in res.stdout
    ok, _ = netem.emulation_available()
    assert ("emulated: 200 Mbit/s" in res.stdout) if ok else ("LOOPBACK" in res.stdout)


def test_runs_csv_values(sweep):
    out, _ = sweep
    with open(out / "runs.csv") as f:
        runs = list(csv.DictReader(f))
    # interleaved: round 1 of both rows, then round 2
    assert [(r["spec"], r["reference"], r["repeat"]) for r in runs] == [
        (spec, ref, k) for k in ("1", "2") for spec, ref in (("fp16", "False"), ("topkc:ratio=0.1", "False"),
                                                             ("none", "True"))]
    for r in runs:  # start-up (process start to the first step's end) apart from the clock
        assert 0 < float(r["startup_s"]) < 300 and 0 < float(r["first_step_s"]) <= float(r["clock_s"])
        if r["tta_s"]:
            assert float(r["tta_steady_s"]) == pytest.approx(max(0.0, float(r["tta_s"]) - float(r["first_step_s"])))
    with open(out / "summary.csv") as f:
        summary = list(csv.DictReader(f))
    assert [(s["spec"], s["repeats"], s["runs_ok"]) for s in summary] == [("fp16", "2", "2"),
                                                                          ("topkc:ratio=0.1", "2", "2"),
                                                                          ("none", "2", "2")]
    for s in summary:
        assert float(s["startup_s_min"]) <= float(s["startup_s"]) <= float(s["startup_s_max"])
    rows = {r["spec"]: r for r in runs if r["repeat"] == "2"}
    # The reference: FP32 (4 bytes a coordinate) on the unthrottled loopback, the sweep's
    # network aside; never the FP16 baseline (its own ratio against FP16's bytes: 0.5).
    ref = rows["none"]
    assert ref["label"] == "no communication (reference: fp32, unthrottled)" and ref["system"] == "horovod"
    assert ref["network_mode"] == "loopback" and ref["bandwidth_mbit"] == ""
    assert float(ref["fp16_bytes_ratio"]) == pytest.approx(0.5)
    params = 64 * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * 10 + 10
    for spec, r in rows.items():
        assert r["status"] == "ok" and int(r["steps"]) == STEPS and int(r["world_size"]) == 2
        assert int(r["params"]) == params and r["git_commit"]
        assert 0 < float(r["clock_s"]) < 120 and 0 < float(r["step_ms_median"]) < 20_000
        shares = float(r["compute_share"]) + float(r["codec_share"]) + float(r["comm_share"])
        assert shares == pytest.approx(1.0, abs=1e-6)
        assert 0.0 <= float(r["final_metric"]) <= 1.0
        assert json.loads(r["versions"])["torch"]
    assert int(rows["fp16"]["bytes_per_step"]) == 2 * params
    assert int(rows["none"]["bytes_per_step"]) == 4 * params
    assert int(rows["topkc:ratio=0.1"]["bytes_per_step"]) < int(rows["fp16"]["bytes_per_step"]) / 4
    assert float(rows["topkc:ratio=0.1"]["fp16_bytes_ratio"]) > 4
    # The weights go as TopKC (chunk 256, k = ceil(0.1 m) chunks of values + m scores + 16
    # vote slots, fp16), the biases below min_numel as fp16; one all-reduce per tensor, no side
    # collective.
    topkc_bytes = sum(2 * (256 * math.ceil(0.1 * m) + m + 16) for m in (64 * HIDDEN // 256, HIDDEN * HIDDEN // 256,
                                                                     -(-HIDDEN * 10 // 256)))
    assert int(rows["topkc:ratio=0.1"]["bytes_per_step"]) == topkc_bytes + 2 * (HIDDEN + HIDDEN + 10)
    assert int(rows["topkc:ratio=0.1"]["side_collectives"]) == 0
    assert rows["fp16"]["network_mode"] in ("netns", "loopback")
    ok, _ = netem.emulation_available()
    assert rows["fp16"]["network_mode"] == ("netns" if ok else "loopback")
    assert float(rows["fp16"]["fp16_bytes_ratio"]) == 1.0


def test_records_json_and_plot(sweep):
    out, _ = sweep
    data = json.loads((out / "results.json").read_text())
    sweep_meta = data["sweep"]
    assert sweep_meta["network"]["mode"] in ("netns", "loopback") and sweep_meta["git_commit"]
    assert sweep_meta["versions"]["horovod"] == "0.28.1" and sweep_meta["cpu_count"] >= 1
    if sweep_meta["network"]["mode"] == "netns":
        lc = sweep_meta["link_check"]
        assert lc["ok"] and lc["ratio"] <= 2.5 and lc["nbytes"] > 0
    for run_id, res in data["results"].items():
        steps, evals = res["steps"], res["evals"]
        assert steps["step"] == list(range(1, STEPS + 1))
        assert all(t2 >= t1 for t1, t2 in zip(steps["t"], steps["t"][1:]))
        assert min(steps["compute_s"]) > 0 and min(steps["codec_s"]) >= 0 and min(steps["comm_s"]) >= 0
        assert evals["step"] == [0, 3, 6] and all(0 <= m <= 1 for m in evals["metric"])
        assert res["meta"]["stop_reason"] == "max_steps"
    for name in ("steps.csv", "evals.csv", "summary.md"):
        assert (out / name).stat().st_size > 0
    with open(out / "tta_digits.png", "rb") as f:
        assert f.read(4) == b"\x89PNG"
    with open(out / "steps.csv") as f:
        assert next(csv.reader(f)) == report.STEP_COLUMNS


def test_update_doc_block_is_what_publish_renders(sweep):
    """tta --update-doc and ``publish`` on the saved results.json write the same block (the
    duration aside: tta counts the writing of its outputs too)."""
    out, _ = sweep
    live = (out / "doc.md").read_text()
    assert "| digits | fp16 |" in live and "![tta_digits.png](tta_digits.png)" in live
    again = out / "again.md"
    again.write_text("intro\n<!-- smoke:start -->\n<!-- smoke:end -->\n")
    res = subprocess.run([sys.executable, "-m", "hvd_gradcomp.bench", "publish", "--results",
                          str(out / "results.json"), "--update-doc", str(again), "--doc-block", "smoke"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert res.returncode == 0, res.stderr
    minutes = re.compile(r"runs in [0-9.]+ min")
    assert minutes.sub("", again.read_text()) == minutes.sub("", live)


def test_nothing_left_behind(sweep):
    """No namespace or /etc/netns folder of a harness that has exited (live sweeps may run)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout if os.geteuid() == 0 else ""
    folders = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
    for name in listed.split() + folders:
        m = netem._NAME_RE.match(name)
        assert not m or netem._pid_alive(int(m.group(1))), f"left behind: {name}"
