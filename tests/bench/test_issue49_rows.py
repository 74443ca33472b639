"""Issue 49's harness pieces, without training or a network: the update-sync clause's overlap
options and the delay(D) clause (parsing, refusals, planning, the worker command), the wait
share (recorded per step, timed by WaitTimer, reported), and FP16's estimated TTA on a slow
link (fp16_estimate: the reference's steps to target x the median step measured here)."""
import json
import types

import pytest

from hvd_gradcomp.bench import fp16_estimate, report, report_table, tta, tta_run
from hvd_gradcomp.bench.worker import Recorder, WaitTimer


# ---- the update-sync clause's overlap options ----

def test_update_sync_overlap_options_parse_and_round_trip():
    row = tta.parse_row("fp16 with update-sync(every=8, overlap=true, fragments=2, eager=false)")
    assert row.update_sync == "every=8,overlap=true,fragments=2,eager=false"
    assert tta.parse_update_sync(row.update_sync) == {"every": 8, "overlap": True, "fragments": 2, "eager": False}
    assert tta.parse_row(row.text()) == row
    run = tta.plan_runs(["lm-comm"], [row.text()], [])[0]
    assert run.label == "fp16 with update-sync(every=8,overlap=true,fragments=2,eager=false)"
    cmd = tta_run.command(run, types.SimpleNamespace(seed=0, max_seconds=0, worker_args="", recipe=None), "x.json")
    assert cmd[cmd.index("--update-sync") + 1] == "every=8,overlap=true,fragments=2,eager=false"


@pytest.mark.parametrize("body, words", [
    ("every=8,overlap=true,fragments=3", "fragments must be an integer >= 1 that divides every=8"),
    ("every=8,overlap=true,fragments=0", "fragments must be an integer >= 1"),
    ("every=8,fragments=2", "fragments=2 needs overlap=true"),
    ("every=8,overlap=false,eager=true", "eager=true needs overlap=true"),
    ("every=8,overlap=1", "option overlap must be true/false, got '1'"),
    ("every=8,fragments=two,overlap=true", "option fragments must be int"),
])
def test_update_sync_overlap_options_refused_clearly(body, words):
    with pytest.raises(ValueError, match=words):
        tta.parse_update_sync(body)
    with pytest.raises(ValueError, match=words):
        tta.parse_compressors(f"fp16; fp16 with update-sync({body})")


# ---- the delay(D) clause ----

def test_delay_clause_parses_and_plans_a_ddp_row_of_ours():
    row = tta.parse_row("fp16 with delay(1)")
    assert (row.spec, row.delay, row.text()) == ("fp16", 1, "fp16 with delay(1)")
    assert tta.parse_row("thc with delay(2) with adamw(lr=1e-3)").text() == "thc with delay(2) with adamw(lr=1e-3)"
    plan = tta.plan_runs(["lm-comm"], ["fp16", "fp16 with delay(1)"], [])
    run = plan[1]
    assert (run.system, run.spec, run.delay, run.label) == ("ddp", "ours:fp16", 1, "fp16 with delay(1) on DDP")
    assert run.row_id == "lm-comm-ddp-ours-fp16-with-delay-1" and run.row_id != plan[0].row_id
    assert run.again(2, 2).delay == 1
    cmd = tta_run.command(run, types.SimpleNamespace(seed=0, max_seconds=0, worker_args="", recipe=None), "x.json")
    assert cmd[cmd.index("--hook") + 1] == "ours:fp16" and cmd[cmd.index("--delay") + 1] == "1"
    assert run.unavailable is None and tta.delay_support(1) is None  # the DDP hook takes delay=1
    deeper = tta.plan_runs(["lm-comm"], ["fp16 with delay(2)"], [])[0]
    assert deeper.unavailable == "torch_backend.ddp's delayed hook takes delay=1 only (step t's mean " \
                                 "applied at step t + 1), not delay=2"


@pytest.mark.parametrize("text, words", [
    ("fp16 with delay(0)", r"delay\(D\) takes an integer D >= 1, got '0'"),
    ("fp16 with delay(x)", r"delay\(D\) takes an integer D >= 1"),
    ("fp16 with delay(1) with delay(2)", "delay given twice"),
    ("fp16 with delay(1) with update-sync(every=8)", "delay and update-sync together are not supported"),
    ("fp16 with accumulate(2) with delay(1)", "delay and accumulate together are not supported"),
    ("fp16 with groups(1) with delay(1)", "delay and groups together are not supported"),
])
def test_delay_clause_refused_clearly(text, words):
    with pytest.raises(ValueError, match=words):
        tta.parse_row(text)


def test_delay_rows_need_a_ddp_workload():
    with pytest.raises(ValueError, match="delay.D. rows run on DDP, which digits-tf has not"):
        tta.plan_runs(["digits-tf"], ["fp16 with delay(1)"], [])


# ---- the wait share ----

def _recorder():
    args = types.SimpleNamespace(compression="fp16", seed=0, batch_size=1, lr=1.0, target=None, optimizer="",
                                 eval_every=1, window=1, epochs_past_target=0, max_epochs=1, max_seconds=0,
                                 max_steps=0, out=None, progress=False)
    return Recorder(args, 0, 2, 10, False, {})


def test_recorder_keeps_the_wait_as_a_part_of_comm():
    rec = _recorder()
    rec.step(1.0, 0.5, 2.0, 0.1, wait_s=1.5)
    rec.step(1.0, 0.5, 2.0, 0.1, wait_s=3.0)   # more than comm: clamped to comm
    rec.step(1.0, 0.5, -1.0, 0.1, wait_s=0.5)  # comm clamped at 0, the wait with it
    rec.step(1.0, 0.5, 2.0, 0.1)               # not measured
    assert rec.steps["wait_s"] == [1.5, 2.0, 0.0, None]
    assert rec.clock == pytest.approx(3.5 * 3 + 1.5)


def test_wait_timer_counts_blocking_calls_inside_watching_only():
    module = types.ModuleType("links")
    calls = []

    def synchronize(handle):
        calls.append(handle)
        return module.allreduce(handle) if handle == "nested" else handle

    module.synchronize, module.allreduce = synchronize, lambda x: x
    ticks = iter(range(0, 1000, 10))  # each clock read: +10 s
    timer = WaitTimer(module, ("synchronize", "allreduce", "missing"), clock=lambda: next(ticks))
    assert module.synchronize("outside") == "outside" and timer.take() == 0.0
    with timer.watching():
        module.synchronize("a")
        module.synchronize("nested")  # its inner allreduce is not counted twice
        module.allreduce("b")
    assert timer.take() == 30.0 and timer.take() == 0.0
    module.synchronize("after")
    assert timer.take() == 0.0
    timer.close()
    assert module.synchronize is synchronize and not hasattr(module, "missing")


def _result(label, spec, times, metrics, update_sync=None, wait=True, meta=None):
    """A worker's record: steps of ``times`` (compute, codec, comm, wait) each, an evaluation
    per step of ``metrics`` (perplexity, lower is better)."""
    n = len(metrics)
    comp, codec, comm, w = times
    t = [(i + 1) * (comp + codec + comm) for i in range(n)]
    steps = {"step": list(range(1, n + 1)), "epoch": [i / 100 for i in range(1, n + 1)], "t": t,
             "compute_s": [comp] * n, "codec_s": [codec] * n, "comm_s": [comm] * n, "loss": [1.0] * n}
    if wait:
        steps["wait_s"] = [w] * n
    m = {"workload": "lm-comm", "framework": "torch", "system": "horovod", "label": label,
         "compression": spec, "target_vs_fp16": 1.02, "higher_is_better": False, "window": 1,
         "update_sync": update_sync, "world_size": 2}
    m.update(meta or {})
    return {"status": "ok", "meta": m, "steps": steps, "bytes_per_step": {"payload": 100, "side": 0},
            "evals": {"step": list(range(1, n + 1)), "epoch": steps["epoch"], "t": t, "metric": list(metrics)}}


NET = {"mode": "emulated", "note": "emulated", "qdisc": "tbf", "bandwidth_mbit": 5.0}


def test_wait_share_in_rows_table_and_csv(tmp_path):
    results = {"a": _result("fp16", "fp16", (1.0, 0.0, 3.0, 3.0), [10, 9, 8]),
               "b": _result("fp16 with update-sync(every=8,overlap=true)", "fp16", (2.0, 0.0, 2.0, 0.5), [10, 9, 8],
                            update_sync="every=8,overlap=true")}
    rows = [report.summarize(k, v, NET) for k, v in results.items()]
    assert rows[0]["wait_share"] == pytest.approx(0.75) and rows[1]["wait_share"] == pytest.approx(0.125)
    assert rows[1]["comm_share"] == pytest.approx(0.5)
    table = report_table.markdown_table(rows, NET, results)
    head = [line for line in table.splitlines() if line.startswith("| workload")][0]
    assert head.split(" | ")[-2:] == ["comm", "wait |"]
    assert "| 75% | 75% |" in table and "| 50% | 12% |" in table
    assert "wait = the share of the clock a step was blocked on the link" in table
    report.write_csvs(tmp_path, rows, results)
    lines = (tmp_path / "steps.csv").read_text().splitlines()
    assert lines[0].split(",")[7] == "wait_s" and lines[1].split(",")[7] == "3.0"
    # Records without the wait (older sweeps, workers that do not measure it): no column.
    old = {"a": _result("fp16", "fp16", (1.0, 0.0, 3.0, 3.0), [10, 9, 8], wait=False)}
    rows = [report.summarize(k, v, NET) for k, v in old.items()]
    assert rows[0]["wait_share"] is None and "| wait" not in report_table.markdown_table(rows, NET, old)


# ---- FP16's estimated TTA on a slow link ----

def _reference(tmp_path):
    """A 50 Mbit/s sweep's results.json: FP16 reaches 1.02 x its final (8.0) at step 3."""
    results = {"lm-comm-horovod-fp16": _result("fp16", "fp16", (0.1, 0.0, 0.1, 0.1), [10, 9, 8.1, 8.0, 8.0])}
    rows = [report.summarize(k, v, dict(NET, bandwidth_mbit=50.0)) for k, v in results.items()]
    report.apply_targets(rows, results)
    path = tmp_path / "ref.json"
    path.write_text(json.dumps({"sweep": {"git_commit": "abcdef0123", "network": {"bandwidth_mbit": 50.0}},
                                "runs": rows, "results": results}))
    return path


def test_reference_is_read_and_refused_when_unusable(tmp_path):
    ref = fp16_estimate.load_reference(_reference(tmp_path), ["lm-comm"])["lm-comm"]
    assert (ref["steps_to_target"], ref["steps"], ref["bandwidth_mbit"]) == (3, 5, 50.0)
    assert ref["target"] == pytest.approx(1.02 * 8.0)
    with pytest.raises(ValueError, match="no FP16 row of workload lm"):
        fp16_estimate.load_reference(_reference(tmp_path), ["lm"])
    with pytest.raises(ValueError, match="ran on 2 workers, this sweep on 4"):
        fp16_estimate.load_reference(_reference(tmp_path), ["lm-comm"], world_size=4)
    assert fp16_estimate.load_reference(_reference(tmp_path), ["lm-comm"], world_size=2)["lm-comm"]["world_size"] == 2
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read a sweep's results.json"):
        fp16_estimate.load_reference(tmp_path / "bad.json", ["lm-comm"])
    with pytest.raises(ValueError, match="--fp16-steps must be an integer >= 1"):
        fp16_estimate.fp16_flags(ref, 0)
    assert fp16_estimate.fp16_flags(ref, 40) == ["--max-steps", "40", "--schedule-steps", "5"]


def test_fp16_stopped_early_gets_the_labelled_estimate(tmp_path):
    ref = fp16_estimate.load_reference(_reference(tmp_path), ["lm-comm"])["lm-comm"]
    # At 5 Mbit/s FP16 ran 2 steps of 4 s (its perplexity still 10, 9.5: far from 8.16).
    fp16 = _result("fp16", "fp16", (1.0, 0.0, 3.0, 3.0), [10, 9.5],
                   meta={"fp16_estimate": fp16_estimate.reference_meta(ref, 2)})
    other = _result("sparseloco with update-sync(every=16)", "sparseloco", (1.0, 0.0, 0.5, 0.5), [10, 9, 8.5, 8.1],
                    update_sync="every=16")
    stops = {}
    run = tta.plan_runs(["lm-comm"], ["fp16"], [])[0]
    tta_run.note_fp16(run, fp16, stops)
    assert stops["lm-comm"] == {"target": pytest.approx(8.16), "fp16_tta_s": 12.0, "cap": 1.5,
                                "max_seconds": 18.0, "fp16_steps": 5, "estimated": True}
    results = {"f": fp16, "o": other}
    other["meta"]["stop_cap"] = stops["lm-comm"]
    rows = [report.summarize(k, v, NET) for k, v in results.items()]
    report.apply_targets(rows, results)
    report.add_baseline_ratios(rows)
    assert rows[0]["tta_s"] == 12.0 and rows[0]["steps_to_target"] == 3  # 3 steps x 4 s
    assert rows[1]["target"] == pytest.approx(8.16) and rows[1]["tta_s"] == 6.0  # step 4 x 1.5 s
    assert rows[1]["tta_vs_fp16"] == pytest.approx(2.0)
    table = report_table.markdown_table(rows, NET, results)
    line = [x for x in table.splitlines() if x.startswith("| lm-comm | fp16 |")][0]
    assert "| 12.0 (est.) |" in line and "| 3 at 50 Mbit/s |" in line
    assert ("fp16 (lm-comm) stopped after 2 steps at 5 Mbit/s: its TTA (est.) is its steps to target at "
            "50 Mbit/s (3, the sweep in") in table
    assert "times its median step time measured here (4000 ms)" in table
    assert "1.5 x FP16's estimated TTA (12.0 s)" in table
    assert "lm-comm 8.16 (1.02 x FP16's final rolling metric in the reference sweep named below)" in table
