"""Issue 25's evaluation pieces (no training here but the optimizer probe's few steps; see
test_adam_smoke.py for a real lm-comm sweep): the ``steps to target`` column, targets
relative to FP16, rows naming an optimizer, lm-comm's defaults and stop rule, the optimizer
probe and its ratios, and the tta-adam block.
"""
import math

import pytest
import torch

from hvd_gradcomp.bench import publish, report, report_plot, report_table, tta, tta_run, tta_sweep
from hvd_gradcomp.bench.worker import parse_optimizer
from hvd_gradcomp.bench.workers import torch_workloads

NET = {"mode": "netns", "bandwidth_mbit": 50.0, "latency_ms": 0.0, "world_size": 2,
       "note": "emulated: 50 Mbit/s per worker link", "qdisc": "tbf rate 50mbit"}


def _lm_result(spec, metric, step_s=0.1, every=10, optimizer=None, factor=1.02, payload=1000, adam=None, label=None):
    """A perplexity run: one evaluation every ``every`` steps (the first at step 0)."""
    n = len(metric)
    steps = (n - 1) * every
    res = {"status": "ok",
           "meta": {"workload": "lm-comm", "framework": "torch", "system": "horovod", "label": label or spec,
                    "compression": spec, "optimizer": optimizer, "target": None, "target_vs_fp16": factor,
                    "higher_is_better": False, "window": 1, "world_size": 2, "steps_run": steps},
           "bytes_per_step": {"payload": payload, "side": 0, "side_collectives": 0},
           "steps": {"step": list(range(1, steps + 1)), "epoch": [i / 100 for i in range(1, steps + 1)],
                     "t": [step_s * i for i in range(1, steps + 1)], "compute_s": [step_s * 0.25] * steps,
                     "codec_s": [0.0] * steps, "comm_s": [step_s * 0.75] * steps, "loss": [1.0] * steps},
           "evals": {"step": [every * i for i in range(n)], "epoch": [every * i / 100 for i in range(n)],
                     "t": [step_s * every * i for i in range(n)], "metric": list(metric)}}
    if adam is not None:
        res["adam"] = adam
    return res


def _sweep():
    fp16 = [100, 20, 10, 8, 6, 5.5, 5.2, 5.05, 5.0, 5.0]  # final 5.0 -> target 5.1 at step 70
    results = {
        "lm-comm-horovod-fp16": _lm_result("fp16", fp16, step_s=0.2, payload=2000),
        "lm-comm-horovod-thc": _lm_result("thc", [100, 20, 10, 8, 6, 5.6, 5.3, 5.2, 5.05, 5.0], step_s=0.1),
        "lm-comm-horovod-topkc": _lm_result("topkc:ratio=0.1", [100, 30, 20, 12, 9, 7, 6.5, 6, 5.9, 5.8],
                                            step_s=0.05, payload=200),
        "lm-comm-horovod-fp16-adamw": _lm_result("fp16", [100, 20, 10, 8, 6, 5.0, 4.0, 4.0, 4.0, 4.0],
                                                 optimizer="adamw(lr=1e-3)", label="fp16 with adamw(lr=1e-3)"),
    }
    rows = [report.summarize(k, v, NET, "abc") for k, v in results.items()]
    report.apply_targets(rows, results)
    report.add_baseline_ratios(rows)
    return rows, results


# ---- targets relative to FP16, steps to target ----

def test_first_reached_and_time_to_target_agree():
    ppl = [200, 20, 12, 10, 9, 9]
    assert report.first_reached(ppl, 10.5, False, window=1) == 3
    assert report.first_reached(ppl, 10.5, False, window=3) == 4
    assert report.first_reached(ppl, 1.0, False) is None and report.first_reached(ppl, None, False) is None
    assert report.time_to_target([0, 1, 2, 3, 4, 5], ppl, 10.5, False, window=3) == 4
    with pytest.raises(ValueError, match="window must be >= 1"):
        report.first_reached(ppl, 10.5, False, window=0)


def test_target_is_a_factor_of_fp16s_final_and_steps_are_counted():
    rows, _ = _sweep()
    fp16, thc, topkc, adamw = rows
    # 1.02 x FP16's final rolling metric (window 1: its last evaluation, 5.0), for every row
    for r in rows:
        assert r["target"] == pytest.approx(5.1) and r["target_vs_fp16"] == 1.02
    assert fp16["steps_to_target"] == 70 and fp16["tta_s"] == pytest.approx(70 * 0.2)
    assert thc["steps_to_target"] == 80 and thc["steps_vs_fp16"] == pytest.approx(80 / 70)
    assert thc["step_time_vs_fp16"] == pytest.approx(2.0) and thc["tta_vs_fp16"] == pytest.approx(14.0 / 8.0)
    assert topkc["steps_to_target"] is None and topkc["tta_s"] is None and topkc["steps_vs_fp16"] is None
    # FP16 under another optimizer is a row, never the baseline nor the target's source
    assert adamw["optimizer"] == "adamw(lr=1e-3)" and adamw["steps_to_target"] == 50
    assert adamw["steps_vs_fp16"] == pytest.approx(50 / 70)
    # no FP16 row: no target, nothing reached
    alone = [report.summarize("t", _lm_result("thc", [100, 5.0]), NET)]
    report.apply_targets(alone, {"t": _lm_result("thc", [100, 5.0])})
    assert alone[0]["target"] is None and alone[0]["steps_to_target"] is None


def test_absolute_targets_get_steps_to_target_too():
    res = _lm_result("fp16", [100, 20, 10, 8], factor=None)
    res["meta"]["target"] = 10.5
    row = report.summarize("a", res, NET)
    assert row["target"] == 10.5 and row["steps_to_target"] == 20 and row["target_vs_fp16"] is None
    saved = dict(row, steps_to_target=None)  # a sweep saved before the column existed
    report.apply_targets([saved], {"a": res})
    assert saved["steps_to_target"] == 20


def test_table_has_steps_to_target_beside_the_step_time_ratio():
    rows, _ = _sweep()
    text = report_table.format_table(rows, NET)
    lines = text.splitlines()
    header = lines[3]
    assert "best DDP TTA/ours  steps to target  FP16 step/ours  final" in header
    assert "lm-comm 5.1 (1.02 x FP16's final rolling metric in this sweep)" in lines[1]
    assert "steps to target = optimizer steps" in lines[1]
    body = {line.split()[1]: line for line in lines[5:8]}
    assert "fp16 with adamw(lr=1e-3)" in lines[8] and "50 (0.71x)" in lines[8]
    assert "70 (1.00x)" in body["fp16"] and "80 (1.14x)" in body["thc"] and "2.00x" in body["thc"]
    assert "not reached" in body["topkc:ratio=0.1"]
    md = report_table.markdown_table(rows, NET)
    assert "| steps to target | FP16 step/ours |" in md
    assert "| lm-comm | fp16 with adamw(lr=1e-3) |" in md
    assert "| 80 (1.14x) | 2.00x |" in md


def test_aggregate_keeps_steps_to_target_and_optimizer_rows_apart():
    rows, results = _sweep()
    again = [dict(r, repeat=2, run_id=r["run_id"] + "-r2") for r in rows]
    summary = report.aggregate([dict(r, run_id=r["run_id"] + "-r1") for r in rows] + again)
    assert [s["spec"] for s in summary] == ["fp16", "thc", "topkc:ratio=0.1", "fp16"]
    assert [s["optimizer"] for s in summary] == [None, None, None, "adamw(lr=1e-3)"]
    assert summary[1]["steps_to_target"] == 80 and summary[1]["steps_vs_fp16"] == pytest.approx(80 / 70)
    assert summary[2]["steps_to_target"] is None


def test_tta_adam_block_is_written_between_its_markers(tmp_path):
    rows, results = _sweep()
    sweep = {"network": NET, "workloads": ["lm-comm"], "date": "d", "git_commit": "c",
             "argv": ["--workloads", "lm-comm"], "cpu_count": 2, "elapsed_s": 600.0, "link_check": None}
    import json
    (tmp_path / "results.json").write_text(json.dumps({"sweep": sweep, "runs": rows, "results": results}))
    doc = tmp_path / "tta.md"
    doc.write_text("a\n<!-- tta-adam:start -->\nold\n<!-- tta-adam:end -->\nb\n<!-- tta-demo:start -->\nx\n<!-- tta-demo:end -->\n")
    assert publish.publish(str(tmp_path / "results.json"), [str(doc)], "tta-adam") == [str(doc)]
    text = doc.read_text()
    block = text.split("<!-- tta-adam:start -->\n")[1].split("<!-- tta-adam:end -->")[0]
    assert "old" not in block and "| 80 (1.14x) | 2.00x |" in block and "steps to target" in block
    assert "command `python -m hvd_gradcomp.bench tta --workloads lm-comm`" in block
    assert text.endswith("<!-- tta-demo:start -->\nx\n<!-- tta-demo:end -->\n") and text.startswith("a\n")


# ---- rows naming an optimizer ----

def test_parse_optimizer():
    assert parse_optimizer("") == (None, {}) and parse_optimizer("adam") == ("adam", {})
    # the workers' earlier spellings (docs/optimizers.md): default, frozen_adamw
    assert parse_optimizer("default") == (None, {})
    assert parse_optimizer("frozen_adamw(freeze_step=3)") == ("frozen-adamw", {"freeze_step": 3})
    with pytest.raises(ValueError, match="'default' .* takes no options"):
        parse_optimizer("default(lr=1)")
    assert parse_optimizer(" frozen-adamw(lr=1e-3, betas=0.9/0.98, freeze_step=100, amsgrad=false) ") == (
        "frozen-adamw", {"lr": 0.001, "betas": (0.9, 0.98), "freeze_step": 100, "amsgrad": False})
    for bad, words in (("adam(", "expected NAME or NAME"), ("lamb(lr=1)", "unknown name 'lamb'"),
                       ("adam(lr)", "expected key=value, got 'lr'"), ("adam(lr=fast)", "option lr must be a number"),
                       ("adamw(betas=0.9)", "option betas must be a number pair b1/b2")):
        with pytest.raises(ValueError, match=words):
            parse_optimizer(bad)


def test_rows_with_an_optimizer_are_planned_labelled_and_passed_on(tmp_path):
    rows = tta.parse_compressors("fp16; topkc:ratio=0.1 with adam(lr=6.3e-3) ;fp32 with sgd")
    assert rows == ["fp16", "topkc:ratio=0.1 with adam(lr=6.3e-3)", "none with sgd"]
    assert tta.parse_row("topkc:ratio=0.1 with frozen-adamw(freeze_step=100)") == (
        "topkc:ratio=0.1", "frozen-adamw(freeze_step=100)", 1, None, 0, 0)
    with pytest.raises(ValueError, match="unknown name 'lamb'"):
        tta.parse_compressors("fp16 with lamb")
    with pytest.raises(ValueError, match="unknown option 'colour'"):
        tta.parse_compressors("topkc:colour=1 with adam")
    plan = tta.plan_runs(["lm-comm"], rows, [])
    assert [r.run_id for r in plan] == ["lm-comm-horovod-fp16", "lm-comm-horovod-topkc-ratio-0-1-with-adam-lr-6-3e-3",
                                        "lm-comm-horovod-none-with-sgd"]
    assert plan[1].label == "topkc:ratio=0.1 with adam(lr=6.3e-3)" and plan[1].optimizer == "adam(lr=6.3e-3)"
    args = tta_sweep.build_parser().parse_args([])
    cmd = tta_run.command(plan[1], args, "o.json")
    assert cmd[2] == "hvd_gradcomp.bench.workers.lm_comm_torch"
    assert cmd[3:7] == ["--compression", "topkc:ratio=0.1", "--optimizer", "adam(lr=6.3e-3)"]
    assert "--optimizer" not in tta_run.command(plan[0], args, "o.json")
    again = tta.interleave(plan, 2)
    assert again[4].optimizer == "adam(lr=6.3e-3)" and again[4].run_id.endswith("-r2")


def test_build_optimizer_imports_lazily_and_fails_clearly():
    model = torch.nn.Linear(3, 2)
    wl = torch_workloads.LMCommWorkload.__new__(torch_workloads.LMCommWorkload)  # optimizer() needs no data
    # the users' recipe (the default): AdamW (0.9, 0.95), weight decay 0.1 on the matrix only
    own = torch_workloads.build_optimizer(wl, model.parameters(), 1e-3, "")
    assert type(own) is torch.optim.AdamW and own.defaults["betas"] == (0.9, 0.95)
    assert [(g["weight_decay"], [tuple(p.shape) for p in g["params"]]) for g in own.param_groups] == [
        (0.1, [(2, 3)]), (0.0, [(2,)])]
    wl.recipe = "adam-constant"  # issue 25's
    assert type(torch_workloads.build_optimizer(wl, model.parameters(), 1e-3, "")) is torch.optim.Adam
    opt = torch_workloads.build_optimizer(wl, model.parameters(), 1e-3, "adamw(weight_decay=0,betas=0.8/0.9)")
    assert type(opt) is torch.optim.AdamW and opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["lr"] == 1e-3
    assert opt.defaults["weight_decay"] == 0
    assert torch_workloads.build_optimizer(wl, model.parameters(), 1e-3, "adam(lr=5e-3)").defaults["lr"] == 5e-3
    # defaults for options a row does not give (the workers' --weight-decay/--freeze-step)
    opt = torch_workloads.build_optimizer(wl, model.parameters(), 1e-3, "adamw", {"adamw": {"weight_decay": 0.0}})
    assert opt.defaults["weight_decay"] == 0.0
    opt = torch_workloads.build_optimizer(wl, model.parameters(), 1e-3, "adamw(weight_decay=0.2)",
                                          {"adamw": {"weight_decay": 0.0}})
    assert opt.defaults["weight_decay"] == 0.2
    with pytest.raises(ValueError, match=r"optimizer adam: torch.optim.Adam\(.*\) rejected its options"):
        torch_workloads.build_optimizer(wl, model.parameters(), 1e-3, "adam(freeze_step=3)")
    try:
        import torch_backend.optim as optim
        present = hasattr(optim, "FrozenVarianceAdamW")
    except ImportError:
        present = False
    if present:  # merged: it builds, as an AdamW that Horovod's DistributedOptimizer can wrap
        opt = torch_workloads.build_optimizer(wl, model.parameters(), 1e-3, "frozen-adamw(freeze_step=5)")
        assert isinstance(opt, torch.optim.AdamW)
    else:
        with pytest.raises(ValueError, match="torch_backend.optim.FrozenVarianceAdamW is not available in this checkout"):
            torch_workloads.build_optimizer(wl, model.parameters(), 1e-3, "frozen-adamw(freeze_step=5)")


# ---- lm-comm's sweep defaults and stop rule ----

def test_lm_comm_sweep_defaults_and_rows_this_checkout_cannot_run(capsys):
    args = tta_sweep.build_parser().parse_args(["--workloads", "lm-comm"])
    plan = tta_sweep.plan_sweep(args)
    planned = capsys.readouterr().err
    assert (args.bandwidth, args.max_seconds, args.ddp_hooks, args.no_comm_reference) == (50.0, 0.0, "off", "off")
    assert plan.link.bandwidth_mbit == 50.0
    labels = [r.label for r in plan.runs]
    assert labels[:3] == ["fp16", "fp16 with accumulate(4)", "fp16 with update-sync(every=8)"]
    assert "topkc:ratio=0.1 with update-sync(every=1)" in labels and "thc" in labels
    assert len(labels) == len(tta.ADAM_ROWS) and all(r.system == "horovod" and not r.reference for r in plan.runs)
    assert plan.runs[1].accumulate == 4 and plan.runs[2].update_sync == "every=8"
    for r in plan.runs:  # a spec this checkout cannot build is planned as a row that says why
        if r.unavailable:
            assert "error_feedback" in r.unavailable or "fp16_warmup" in r.unavailable, r.unavailable
            res = tta_run.execute(None, r, args, "/nonexistent")  # no launch, no network
            assert res["status"].startswith("not run: ") and res["meta"]["label"] == r.label
            assert f"default row {r.label!r} cannot run on this checkout" in planned
            assert f"tta: run {r.run_id} not run: " in capsys.readouterr().err
    # Other sweeps keep their defaults (make demo unchanged); a mixed sweep too.
    for argv in ([], ["--workloads", "lm,lm-comm"]):
        args = tta_sweep.build_parser().parse_args(argv)
        tta_sweep.plan_sweep(args)
        assert (args.bandwidth, args.max_seconds, args.ddp_hooks, args.no_comm_reference) == (
            500.0, 120.0, tta.DEFAULT_DDP_HOOKS, "on")
    args = tta_sweep.build_parser().parse_args(["--workloads", "lm-comm", "--bandwidth", "100", "--compressors", "fp16"])
    plan = tta_sweep.plan_sweep(args)
    assert args.bandwidth == 100.0 and [r.label for r in plan.runs] == ["fp16"]


def test_rows_after_fp16_stop_at_its_target_or_a_multiple_of_its_tta():
    plan = tta.plan_runs(["lm-comm", "lm"], ["fp16", "thc", "fp16 with adamw", "fp16 with accumulate(2)"], [])
    stops = {}
    assert tta_run.stop_flags(plan[1], stops) == []  # FP16 has not run yet
    # window 1, an evaluation every 10 steps of 0.1 s: final 5.0 -> target 5.1, reached at step 80 (8 s)
    fp16 = _lm_result("fp16", [100, 20, 10, 8, 6, 5.5, 5.2, 5.15, 5.05, 5.0])
    tta_run.note_fp16(plan[1], fp16, stops)  # not the baseline: nothing noted
    tta_run.note_fp16(plan[3], fp16, stops)  # fp16 with accumulation is not the baseline either
    assert stops == {}
    tta_run.note_fp16(plan[0], dict(fp16, status="failed (exit 1)"), stops)
    assert stops == {}
    tta_run.note_fp16(plan[0], fp16, stops)
    stop = stops["lm-comm"]
    assert stop["target"] == pytest.approx(5.1) and stop["fp16_tta_s"] == pytest.approx(8.0)
    assert stop["cap"] == 1.5 and stop["max_seconds"] == pytest.approx(12.0) and stop["fp16_steps"] == 90
    assert tta_run.stop_flags(plan[1], stops) == ["--target", "5.1", "--epochs-past-target", "0",
                                              "--max-seconds", "12", "--max-epochs", "1e9",
                                              "--schedule-steps", "90"]
    assert tta_run.stop_flags(plan[2], stops)[:2] == ["--target", "5.1"]  # fp16 under another optimizer
    assert tta_run.stop_flags(plan[3], stops)[:2] == ["--target", "5.1"]  # and with accumulation
    assert tta_run.stop_flags(plan[0], stops) == []  # the baseline runs its budget
    other = {}
    tta_run.note_fp16(plan[0], fp16, other, cap=2.0)  # --tta-cap 2
    assert other["lm-comm"]["max_seconds"] == pytest.approx(16.0)
    lm_fp16 = _lm_result("fp16", [100, 10])
    lm_fp16["meta"]["target_vs_fp16"] = None
    tta_run.note_fp16(plan[4], lm_fp16, stops)  # lm has an absolute target
    assert "lm" not in stops and tta_run.stop_flags(plan[5], stops) == []
    args = tta_sweep.build_parser().parse_args(["--worker-args", "--max-seconds 4"])
    cmd = tta_run.command(plan[1], args, "o.json", tta_run.stop_flags(plan[1], stops))
    assert cmd[-2:] == ["--max-seconds", "4"] and cmd.index("--target") < len(cmd) - 2
    args = tta_sweep.build_parser().parse_args(["--budget-epochs", "0.5"])  # FP16's budget; the others: 1e9
    cmd = tta_run.command(plan[1], args, "o.json", tta_run.stop_flags(plan[1], stops))
    assert cmd[cmd.index("--max-epochs") + 1] == "0.5" and cmd[len(cmd) - 1 - cmd[::-1].index("--max-epochs") + 1] == "1e9"
    assert tta_run.command(plan[0], args, "o.json")[-2:] == ["--max-epochs", "0.5"]
    with pytest.raises(ValueError, match="--budget-epochs must be > 0"):
        tta_sweep.plan_sweep(tta_sweep.build_parser().parse_args(["--workloads", "lm-comm", "--budget-epochs", "0"]))
    with pytest.raises(ValueError, match="--tta-cap must be > 0"):
        tta_sweep.plan_sweep(tta_sweep.build_parser().parse_args(["--workloads", "lm-comm", "--tta-cap", "0"]))


def test_the_table_says_what_stopped_the_rows_after_fp16():
    rows, results = _sweep()
    assert report_table.stop_note(rows, results) == ""  # nothing recorded: nothing said
    results["lm-comm-horovod-thc"]["meta"]["stop_cap"] = {"target": 5.1, "fp16_tta_s": 14.0, "cap": 1.5,
                                                          "max_seconds": 21.0, "fp16_steps": 90}
    note = "lm-comm: every row after FP16 stopped at the target or when its training clock passed 1.5 x FP16's TTA (14.0 s), i.e. 21.0 s"
    assert note in report_table.stop_note(rows, results) and note in report_table.markdown_table(rows, NET, results)
    assert note not in report_table.markdown_table(rows, NET)
    del results["lm-comm-horovod-thc"]["meta"]["stop_cap"]  # a sweep of the step cap (issue 25's)
    results["lm-comm-horovod-thc"]["meta"].update(target=5.1, argv=["w", "--max-steps", "135"])
    assert report_table.stop_note(rows, results) == (
        "lm-comm: every row after FP16 stopped at the target or after 135 steps (1.50 x FP16's 90 steps).")


# ---- rows that accumulate gradients or sync compressed updates; the recipe ----

def test_accumulate_and_update_sync_rows():
    row = tta.parse_row("topkc:ratio=0.1 with update-sync(every=8, outer_lr=0.5) with adamw(lr=1e-3)")
    assert row == ("topkc:ratio=0.1", "adamw(lr=1e-3)", 1, "every=8,outer_lr=0.5", 0, 0)
    assert row.text() == "topkc:ratio=0.1 with update-sync(every=8,outer_lr=0.5) with adamw(lr=1e-3)"
    assert tta.parse_row("fp16 with update-sync").update_sync == "every=1"
    assert tta.parse_row("fp16 with accumulate( 4 )").accumulate == 4
    for bad, words in (("fp16 with accumulate(0)", r"accumulate\(K\) takes an integer K >= 1"),
                       ("fp16 with accumulate(2) with accumulate(3)", "accumulate given twice"),
                       ("fp16 with accumulate(2) with update-sync(every=2)", "not supported"),
                       ("fp16 with update-sync(every=0)", "every must be >= 1"),
                       ("fp16 with update-sync(often=2)", "key one of"),
                       ("fp16 with update-sync(nesterov=maybe)", "nesterov must be true/false"),
                       ("fp16 with update-sync(outer_momentum=1)", r"outer_momentum must be in \[0, 1\)"),
                       ("fp16 with adam with sgd", "a second optimizer clause")):
        with pytest.raises(ValueError, match=words):
            tta.parse_compressors(bad)
    rows = tta.parse_compressors("fp16; fp16 with accumulate(4); fp16 with update-sync(every=8); "
                                 "topkc:ratio=0.1 with update-sync(every=1)")
    plan = tta.plan_runs(["lm-comm"], rows, [])
    assert [r.run_id for r in plan] == ["lm-comm-horovod-fp16", "lm-comm-horovod-fp16-with-accumulate-4",
                                        "lm-comm-horovod-fp16-with-update-sync-every-8",
                                        "lm-comm-horovod-topkc-ratio-0-1-with-update-sync-every-1"]
    assert [r.label for r in plan][1:3] == ["fp16 with accumulate(4)", "fp16 with update-sync(every=8)"]
    args = tta_sweep.build_parser().parse_args(["--recipe", "adam-constant"])
    cmd = tta_run.command(plan[1], args, "o.json")
    assert cmd[cmd.index("--accumulate") + 1] == "4" and cmd[cmd.index("--recipe") + 1] == "adam-constant"
    cmd = tta_run.command(plan[3], args, "o.json")
    assert cmd[cmd.index("--update-sync") + 1] == "every=1" and "--accumulate" not in cmd
    assert "--recipe" not in tta_run.command(tta.plan_runs(["lm"], ["fp16"], [])[0], args, "o.json")
    assert tta.interleave(plan, 2)[6].update_sync == "every=8"
    with pytest.raises(ValueError, match="PyTorch workloads only, not on digits-tf"):
        tta.plan_runs(["digits-tf"], ["fp16 with accumulate(2)"], [])
    # in the report: neither is the FP16 baseline, and each is a row of its own
    res = {"a": _lm_result("fp16", [10, 5.0]), "b": _lm_result("fp16", [10, 4.0]), "c": _lm_result("fp16", [10, 4.5])}
    res["b"]["meta"]["accumulate"] = 4
    res["c"]["meta"]["update_sync"] = "every=8"
    rows = [report.summarize(k, v, NET) for k, v in res.items()]
    report.apply_targets(rows, res)
    assert [r["target"] for r in rows] == [pytest.approx(5.1)] * 3  # from row a alone
    assert len(report.aggregate(rows)) == 3
    assert report_plot.converged_levels(rows) == {"FP16": pytest.approx(5.0)}  # row a's level only
    text = report_table.markdown_table(rows, NET)
    assert "accumulate(K) rows: K micro-batches" in text and "update-sync rows: each rank steps" in text


def test_groups_rows():
    """``with groups(G)``: Horovod's num_groups for the row, a row (and row id) of its own,
    never the FP16 baseline; refused with update sync and off the PyTorch workloads."""
    row = tta.parse_row("thc with adamw(lr=1e-3) with groups( 2 ) with accumulate(2)")
    assert (row.groups, row.accumulate, row.optimizer) == (2, 2, "adamw(lr=1e-3)")
    assert row.text() == "thc with accumulate(2) with groups(2) with adamw(lr=1e-3)"
    for bad, words in (("thc with groups(0)", r"groups\(G\) takes an integer G >= 1"),
                       ("thc with groups(x)", r"groups\(G\) takes an integer"),
                       ("thc with groups(1) with groups(2)", "groups given twice"),
                       ("thc with groups(1) with update-sync(every=2)", "groups and update-sync together")):
        with pytest.raises(ValueError, match=words):
            tta.parse_compressors(bad)
    plan = tta.plan_runs(["lm-comm"], tta.parse_compressors("fp16; fp16 with groups(1); thc with groups(3)"), [])
    assert [r.run_id for r in plan] == ["lm-comm-horovod-fp16", "lm-comm-horovod-fp16-with-groups-1",
                                        "lm-comm-horovod-thc-with-groups-3"]
    assert [tta_run.is_fp16_baseline(r) for r in plan] == [True, False, False]
    assert plan[2].label == "thc with groups(3)" and tta.interleave(plan, 2)[5].groups == 3
    args = tta_sweep.build_parser().parse_args([])
    cmd = tta_run.command(plan[2], args, "o.json")
    assert cmd[cmd.index("--num-groups") + 1] == "3"
    assert "--num-groups" not in tta_run.command(plan[0], args, "o.json")
    with pytest.raises(ValueError, match="PyTorch workloads only, not on digits-tf"):
        tta.plan_runs(["digits-tf"], ["fp16 with groups(2)"], [])
    res = {"a": _lm_result("fp16", [10, 5.0]), "b": _lm_result("fp16", [10, 4.0])}
    res["b"]["meta"]["num_groups"] = 1
    rows = [report.summarize(k, v, NET) for k, v in res.items()]
    report.apply_targets(rows, res)
    assert [r["num_groups"] for r in rows] == [0, 1] and [r["target"] for r in rows] == [pytest.approx(5.1)] * 2
    assert len(report.aggregate(rows)) == 2
    assert report_plot.converged_levels(rows) == {"FP16": pytest.approx(5.0)}
    assert "groups(G) rows: Horovod's num_groups=G" in report_table.markdown_table(rows, NET)


def test_worker_refuses_groups_with_update_sync(capsys):
    """A worker launched by hand refuses --num-groups with --update-sync (which would ignore
    the groups yet record them), before Horovod starts."""
    from hvd_gradcomp.bench.workers import digits_torch
    with pytest.raises(SystemExit):
        digits_torch.main(["--num-groups", "2", "--update-sync", "every=2"], workload="lm-comm")
    assert "--num-groups and --update-sync together are not supported" in capsys.readouterr().err


def test_lr_schedule_warms_up_and_decays_to_a_tenth():
    f = torch_workloads.lr_factor
    assert [f(s, 100) for s in (1, 3, 5)] == [pytest.approx(0.2), pytest.approx(0.6), 1.0]  # W = 5
    assert f(100, 100) == pytest.approx(0.1) and f(500, 100) == pytest.approx(0.1)
    mid = 5 + (100 - 5) / 2  # half way through the decay: (1 + 0.1) / 2
    assert f(mid, 100) == pytest.approx(0.55)
    assert all(f(s, 100) >= f(s + 1, 100) for s in range(5, 120))
    with pytest.raises(ValueError, match="total must be >= 1"):
        f(1, 0)
    model = torch.nn.Linear(3, 2)
    wl = torch_workloads.LMCommWorkload.__new__(torch_workloads.LMCommWorkload)
    opt = wl.optimizer(model.parameters(), 2e-3)
    schedule = wl.schedule(opt, 40)
    assert schedule.set(1) == pytest.approx(0.5) and [g["lr"] for g in opt.param_groups] == [pytest.approx(1e-3)] * 2
    schedule.set(40)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-4)
    wl.recipe = "adam-constant"
    assert wl.schedule(opt, 40) is None


# ---- the optimizer probe and its ratios ----

def test_adam_probe_logs_update_rms_and_second_moment_against_float64():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    probe = torch_workloads.AdamProbe(model.named_parameters(), opt, every=3, window=2)
    x = torch.randn(8, 4)
    expect_u2 = {n: 0.0 for n, _ in model.named_parameters()}
    expect_g2 = dict(expect_u2)
    for step in range(1, 7):
        opt.zero_grad()
        model(x).square().mean().backward()
        before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}
        probe.before(step)
        opt.step()
        probe.after(step)
        if step in (5, 6):  # the second window: steps 5 and 6
            for n, p in model.named_parameters():
                expect_u2[n] += ((p.detach().double() - before[n]) ** 2).mean().item() / 2
                expect_g2[n] += (grads[n] ** 2).mean().item() / 2
    rec = probe.records()
    assert rec["steps"] == [3, 6] and rec["every"] == 3 and rec["window"] == 2
    for n, p in model.named_parameters():
        t = rec["tensors"][n]
        assert t["numel"] == p.numel() and len(t["update_rms"]) == 2
        assert t["update_rms"][1] == pytest.approx(math.sqrt(expect_u2[n]), rel=1e-9)
        assert t["grad_rms"][1] == pytest.approx(math.sqrt(expect_g2[n]), rel=1e-9)
        assert t["v_mean"][1] == pytest.approx(opt.state[p]["exp_avg_sq"].double().mean().item(), rel=1e-12)
        assert t["m_rms"][1] == pytest.approx(opt.state[p]["exp_avg"].double().square().mean().sqrt().item(), rel=1e-12)
    off = torch_workloads.AdamProbe(model.named_parameters(), opt, every=0)
    off.before(1)
    off.after(1)
    assert off.records()["steps"] == []
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # no second moment: None
    p2 = torch_workloads.AdamProbe(model.named_parameters(), sgd, every=1, window=1)
    p2.before(1)
    sgd.step()
    p2.after(1)
    assert p2.records()["tensors"]["0.weight"]["v_mean"] == [None]


def test_adam_ratios_are_geometric_means_against_fp16(tmp_path):
    def rec(v, u):
        return {"every": 10, "window": 10, "steps": [10, 20],
                "tensors": {"a": {"numel": 4, "v_mean": v[0], "update_rms": u[0], "grad_rms": [1.0, 1.0], "m_rms": [0, 0]},
                            "b": {"numel": 9, "v_mean": v[1], "update_rms": u[1], "grad_rms": [1.0, 1.0], "m_rms": [0, 0]}}}
    base = rec(([1.0, 1.0], [2.0, 2.0]), ([1.0, 1.0], [1.0, 1.0]))
    ours = rec(([10.0, 4.0], [20.0, 2.0]), ([0.5, 1.0], [0.2, 1.0]))
    results = {"f": _lm_result("fp16", [10, 5], adam=base), "t": _lm_result("topkc:ratio=0.1", [10, 6], adam=ours),
               "n": _lm_result("thc", [10, 6])}
    rows = [report.summarize(k, v, NET) for k, v in results.items()]
    lines = report.adam_ratios(rows, results, min_numel=1)
    assert [(x["run_id"], x["step"]) for x in lines] == [("t", 10), ("t", 20)]
    big = report.adam_ratios(rows, results, min_numel=9)  # tensor b alone
    assert big[1]["v_ratio"] == pytest.approx(1.0) and big[1]["tensors"] == 1  # 2 / 2; both: sqrt(4 * 1)
    assert lines[0]["v_ratio"] == pytest.approx(10.0) and lines[1]["v_ratio"] == pytest.approx(math.sqrt(4.0))
    assert lines[0]["update_ratio"] == pytest.approx(math.sqrt(0.5 * 0.2)) and lines[1]["update_ratio"] == pytest.approx(1.0)
    assert lines[0]["grad_ratio"] == pytest.approx(1.0) and lines[0]["tensors"] == 2
    md = report.format_adam_ratios(lines)
    assert md.splitlines()[2] == "| topkc:ratio=0.1 | 10 | 10 | 0.316 | 1 |"
    assert report.format_adam_ratios([]) == ""
    report.write_csvs(str(tmp_path), rows, results)
    lines = (tmp_path / "adam.csv").read_text().splitlines()
    assert lines[0].split(",") == report.ADAM_COLUMNS and len(lines) == 1 + 2 * 2 * 2
    assert lines[1] == "f,10,a,4,1.0,1.0,1.0,0"
