"""The time-to-accuracy harness's pieces (no training here; see test_tta_smoke.py for a sweep).

Spec and hook parsing, run planning, the summaries, the CSV/JSON schema, the table, the plots,
repeats, the no-communication reference and the doc update (the worker's records, the rolling
mean, time-to-target and the stop rule: test_worker_records.py).
"""
import csv
import importlib.util
import json
import os
import sys

import pytest

from hvd_gradcomp.bench import publish, report, report_plot, report_table, tta, tta_hooks, tta_run, tta_sweep


# ---- specs, hooks, plan ----

def test_parse_compressors_accepts_specs_with_commas_and_fp32_alias():
    specs = tta.parse_compressors(" fp32; fp16 ;topkc:ratio=0.01,chunk=256;")
    assert specs == ["none", "fp16", "topkc:ratio=0.01,chunk=256"]
    # Compressor specs, as the workers' Compression.from_spec reads them: min_numel is the
    # routing's option, accepted for every scheme.
    assert tta.parse_compressors("thc:min_numel=512; topk:ratio=0.1,min_numel=8") == [
        "thc:min_numel=512", "topk:ratio=0.1,min_numel=8"]


@pytest.mark.parametrize("text, words", [
    ("nosuch", "unknown compressor 'nosuch'"),
    ("topkc:ratio=2", "topkc: ratio must be a number in (0, 1]"),
    ("topkc:colour=1", "unknown option 'colour'"),
    ("topkc:chunk=8,ratio", "expected key=value"),
    ("thc:min_numel=0", "thc: min_numel must be an integer >= 1, got 0"),
    (" ; ", "expected at least one compressor spec"),
])
def test_parse_compressors_rejects_bad_specs(text, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("]", r"\]")):
        tta.parse_compressors(text)


def test_default_specs_are_buildable_and_skip_missing(monkeypatch):
    ok, skipped = tta.default_specs()
    assert ok[:2] == ["none", "fp16"]
    assert {"topk:ratio=0.1", "topkc:ratio=0.1"} <= set(ok)
    monkeypatch.setattr(tta, "DEFAULT_CANDIDATES", ("fp16", "notyet:rank=2", "topkc:nosuch=1"))
    ok, skipped = tta.default_specs()
    assert ok == ["fp16"]
    assert [s for s, _ in skipped] == ["notyet:rank=2", "topkc:nosuch=1"]
    assert "unknown compressor 'notyet'" in skipped[0][1]


def test_parse_ddp_hooks():
    assert tta_hooks.parse_ddp_hooks("fp16; powersgd:rank=4") == ["fp16", "powersgd:rank=4"]
    assert tta_hooks.parse_ddp_hooks("off") == [] and tta_hooks.parse_ddp_hooks("") == []
    for bad in ("topkc", "powersgd:ratio=2", "fp16:x=1"):
        with pytest.raises(ValueError, match="ddp hook must be"):
            tta_hooks.parse_ddp_hooks(bad)
    # this project's compressors as DDP hooks: "<spec> on DDP" rows
    assert tta_hooks.parse_ddp_hooks("ours:thc; ours:powersgd:rank=4") == ["ours:thc", "ours:powersgd:rank=4"]
    with pytest.raises(ValueError):
        tta_hooks.parse_ddp_hooks("ours:nosuchscheme")
    plan = tta.plan_runs(["digits"], [], ["ours:thc"])
    assert [(r.system, r.spec, r.label) for r in plan] == [("ddp", "ours:thc", "thc on DDP")]


def test_plan_runs_orders_and_labels():
    plan = tta.plan_runs(["digits", "digits-tf"], ["none", "topkc:ratio=0.1"], ["fp16", "powersgd:rank=4"])
    ids = [r.run_id for r in plan]
    assert ids == ["digits-horovod-none", "digits-horovod-topkc-ratio-0-1", "digits-ddp-fp16",
                   "digits-ddp-powersgd-rank-4", "digits-tf-horovod-none", "digits-tf-horovod-topkc-ratio-0-1"]
    assert plan[2].label == "DDP fp16_compress_hook" and plan[3].label == "DDP powerSGD_hook rank=4"
    assert plan[4].framework == "tensorflow"
    with pytest.raises(ValueError, match="unknown workload 'mnist'"):
        tta.plan_runs(["mnist"], ["fp16"], [])


def test_plan_leaves_auto_out_of_tensorflow_workloads(capsys):
    plan = tta.plan_runs(["digits", "digits-tf"], ["fp16", "auto", "*.bias -> fp16; auto"], [])
    assert [r.run_id for r in plan] == ["digits-horovod-fp16", "digits-horovod-auto",
                                        "digits-horovod-bias-fp16-auto", "digits-tf-horovod-fp16"]
    err = capsys.readouterr().err
    assert "tta: auto skipped on digits-tf: auto runs eagerly only" in err
    assert err.count("skipped on digits-tf") == 2


def test_tensorflow_eager_workload_runs_auto_and_every_row_eagerly(tmp_path, capsys):
    """digits-tf-eager: auto is planned, and every Horovod row's worker gets --eager, so auto
    and the fixed compressors run their step in the same mode."""
    plan = tta.plan_runs(["digits-tf-eager"], ["fp16", "auto"], [])
    assert [r.run_id for r in plan] == ["digits-tf-eager-horovod-fp16", "digits-tf-eager-horovod-auto"]
    assert "skipped" not in capsys.readouterr().err
    args = tta_sweep.build_parser().parse_args([])
    for r in plan:
        cmd = tta_run.command(r, args, str(tmp_path / "r.json"))
        assert cmd[2] == "hvd_gradcomp.bench.workers.digits_tf" and cmd.count("--eager") == 1
    row = {"workload": "digits-eager", "framework": "tensorflow"}
    assert report.workload_name(row) == "digits-tf-eager"


def test_workers_are_launched_as_modules_of_the_package(tmp_path):
    args = tta_sweep.build_parser().parse_args(["--worker-args", "--max-steps 3", "--max-seconds", "9"])
    out = str(tmp_path / "r.json")
    plan = tta.plan_runs(["digits", "lm", "digits-tf"], ["fp16"], ["powersgd:rank=4"])
    commands = {r.run_id: tta_run.command(r, args, out) for r in plan}
    expect = {"digits-horovod-fp16": "digits_torch", "digits-ddp-powersgd-rank-4": "ddp_torch",
              "lm-horovod-fp16": "lm_torch", "lm-ddp-powersgd-rank-4": "ddp_torch",
              "digits-tf-horovod-fp16": "digits_tf"}
    assert set(commands) == set(expect)
    for run_id, cmd in commands.items():
        module = "hvd_gradcomp.bench.workers." + expect[run_id]
        assert cmd[:3] == [sys.executable, "-m", module], run_id
        assert importlib.util.find_spec(module) is not None
        assert not any(a.endswith(".py") for a in cmd), cmd  # never a file path
        assert cmd[-9:] == ["--seed", "0", "--out", out, "--progress", "--max-seconds", "9.0",
                            "--max-steps", "3"], cmd
    ddp = commands["lm-ddp-powersgd-rank-4"]
    assert ddp[3:7] == ["--workload", "lm", "--hook", "powersgd:rank=4"]
    assert commands["digits-horovod-fp16"][3:5] == ["--compression", "fp16"]


def test_ddp_bucket_cap_reaches_our_ddp_rows_only(tmp_path, capsys):
    """--ddp-bucket-cap-mb: our hooks' DDP rows (and DDP fp32) get --bucket-cap-mb; Horovod rows
    and DDP's own fp16/PowerSGD hooks (one bucket: powerSGD_hook hangs on Gloo with several) do
    not; a cap not above 0 is refused at planning, and the worker refuses it for DDP's hooks."""
    from hvd_gradcomp.bench.workers import ddp_torch
    args = tta_sweep.build_parser().parse_args(["--ddp-bucket-cap-mb", "0.25"])
    plan = tta.plan_runs(["lm-comm"], ["fp16", "thc with delay(1)"], ["ours:thc", "fp16", "powersgd:rank=4", "fp32"])
    caps = {r.run_id: tta_run.command(r, args, str(tmp_path / "r.json")) for r in plan}
    got = {k: (c[c.index("--bucket-cap-mb") + 1] if "--bucket-cap-mb" in c else None) for k, c in caps.items()}
    assert got == {"lm-comm-horovod-fp16": None, "lm-comm-ddp-ours-thc-with-delay-1": "0.25",
                   "lm-comm-ddp-ours-thc": "0.25", "lm-comm-ddp-fp16": None,
                   "lm-comm-ddp-powersgd-rank-4": None, "lm-comm-ddp-fp32": "0.25"}, got
    bad = tta_sweep.build_parser().parse_args(["--workloads", "lm-comm", "--ddp-bucket-cap-mb", "0"])
    with pytest.raises(ValueError, match="--ddp-bucket-cap-mb must be > 0"):
        tta_sweep.plan_sweep(bad)
    with pytest.raises(SystemExit):
        ddp_torch.main(["--workload", "lm-comm", "--hook", "powersgd:rank=4", "--bucket-cap-mb", "1"])
    assert "--bucket-cap-mb must be > 0 and is for --hook ours:<spec> or none only" in capsys.readouterr().err


# ---- summaries, CSV/JSON, table, plots ----

def _fake_result(spec, system="horovod", step_s=0.1, payload=8000, reach_at=3, higher=True):
    n = 10
    metric = [0.5 + 0.05 * i for i in range(n)] if higher else [50.0 / (1 + i) for i in range(n)]
    return {"status": "ok", "bytes_per_step": {"payload": payload, "side": 40, "side_collectives": 2},
            "meta": {"workload": "digits", "framework": "torch", "system": system, "label": spec,
                     "compression": spec, "window": 1, "higher_is_better": higher, "target": 0.62 if higher else 10,
                     "world_size": 2, "seed": 0, "params": 4000, "metric": "test accuracy",
                     "versions": {"torch": "x"}, "wall_seconds": 3.0, "stop_reason": "target+epochs"},
            "steps": {"step": list(range(1, n + 1)), "epoch": [i / 5 for i in range(1, n + 1)],
                      "t": [step_s * i for i in range(1, n + 1)], "compute_s": [step_s * 0.5] * n,
                      "codec_s": [step_s * 0.1] * n, "comm_s": [step_s * 0.4] * n, "loss": [1.0] * n},
            "evals": {"step": list(range(n)), "epoch": [i / 5 for i in range(n)],
                      "t": [step_s * i for i in range(n)], "metric": metric}}


NET = {"mode": "netns", "bandwidth_mbit": 500.0, "latency_ms": 0.0, "note": "emulated: 500 Mbit/s per worker link",
       "qdisc": "tbf rate 500mbit"}
LOOP = {"mode": "loopback", "bandwidth_mbit": None, "latency_ms": None,
        "note": "LOOPBACK: no rate limit, communication nearly free (not running as root)"}


def _rows_and_results(network=NET):
    results = {"a-fp16": _fake_result("fp16", step_s=0.2), "a-topkc": _fake_result("topkc:ratio=0.1", payload=800),
               "a-ddp": _fake_result("ddp:fp16", system="ddp", step_s=0.4),
               "a-bad": {"status": "failed (exit 1)", "meta": {"workload": "digits", "framework": "torch",
                                                               "system": "horovod", "label": "thc", "compression": "thc"}}}
    rows = [report.summarize(k, v, network, "abc123") for k, v in results.items()]
    return report.add_baseline_ratios(rows), results


def test_summarize_fields_and_baseline_ratios():
    rows, _ = _rows_and_results()
    fp16, topkc, ddp, bad = rows
    assert fp16["tta_s"] == pytest.approx(0.6)  # 0.5 + 0.05 i >= 0.62 from i = 3, at t = 0.2 i
    assert topkc["tta_s"] == pytest.approx(0.3)
    assert topkc["tta_vs_fp16"] == pytest.approx(2.0)
    assert topkc["fp16_bytes_ratio"] == pytest.approx(8040 / 840)
    assert ddp["tta_vs_fp16"] == pytest.approx(1.0)  # its own system's FP16 baseline
    assert fp16["compute_share"] + fp16["codec_share"] + fp16["comm_share"] == pytest.approx(1.0)
    assert fp16["codec_share"] == pytest.approx(0.1) and fp16["step_ms_median"] == pytest.approx(200)
    assert fp16["bytes_per_step"] == 8040 and fp16["network_mode"] == "netns" and fp16["git_commit"] == "abc123"
    assert bad["status"] == "failed (exit 1)" and bad["tta_s"] is None and bad["steps"] is None


def test_csv_and_json_schema(tmp_path):
    rows, results = _rows_and_results()
    report.write_csvs(str(tmp_path), rows, results)
    report.write_json(str(tmp_path / "results.json"), {"network": NET}, rows, results)
    with open(tmp_path / "runs.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == report.RUN_COLUMNS
        runs = list(reader)
    assert [r["run_id"] for r in runs] == ["a-fp16", "a-topkc", "a-ddp", "a-bad"]
    assert float(runs[1]["tta_vs_fp16"]) == pytest.approx(2.0)
    with open(tmp_path / "steps.csv") as f:
        steps = list(csv.reader(f))
    assert steps[0] == report.STEP_COLUMNS and len(steps) == 1 + 3 * 10
    with open(tmp_path / "evals.csv") as f:
        evals = list(csv.reader(f))
    assert evals[0] == report.EVAL_COLUMNS and len(evals) == 1 + 3 * 10
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data) == {"sweep", "runs", "results"} and data["runs"][0]["run_id"] == "a-fp16"


def test_table_says_loopback_and_marks_failures():
    rows, _ = _rows_and_results(LOOP)
    text = report_table.format_table(rows, LOOP)
    assert text.splitlines()[0].startswith("Network: LOOPBACK")
    assert "thc [failed (exit 1)]" in text and "2.00x" in text
    md = report_table.markdown_table(rows, LOOP)
    assert "LOOPBACK" in md and md.count("\n| ") == 5  # header + 4 runs
    assert all(r["network_mode"] == "loopback" for r in rows)


@pytest.mark.parametrize("higher", [True, False])
def test_plot_writes_png(tmp_path, higher):
    results = {"fp16": _fake_result("fp16", higher=higher), "none": _fake_result("none", step_s=0.3, higher=higher),
               "ddp": _fake_result("ddp:fp16", system="ddp", higher=higher)}
    rows = [report.summarize(k, v, NET) for k, v in results.items()]
    path = report_plot.plot(str(tmp_path / "p.png"), rows, results, "digits", NET)
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 10_000


def test_update_doc_replaces_only_the_block(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("intro\n<!-- tta-demo:start -->\nold\n<!-- tta-demo:end -->\noutro\n")
    report.update_doc(str(doc), "| new |")
    assert doc.read_text() == "intro\n<!-- tta-demo:start -->\n| new |\n<!-- tta-demo:end -->\noutro\n"
    doc.write_text("no markers")
    with pytest.raises(ValueError, match="expected the markers"):
        report.update_doc(str(doc), "x")


def test_update_doc_is_repeatable():
    args = tta_sweep.build_parser().parse_args(["--update-doc", "docs/tta.md", "--update-doc", "README.md"])
    assert args.update_doc == ["docs/tta.md", "README.md"]
    assert tta_sweep.build_parser().parse_args([]).update_doc == []


# ---- start-up split, repeats ----

def test_summarize_splits_startup_from_steady_clock():
    res = _fake_result("fp16", step_s=0.2)
    res["steps"]["t"][0] = 5.0  # a slow first step (negotiation, tracing)
    res["steps"]["t"] = [5.0 + 0.2 * i for i in range(10)]
    res["evals"]["t"] = [0.0] + [5.0 + 0.2 * i for i in range(9)]
    res["meta"]["startup_s"] = 7.5
    row = report.summarize("a", res, NET)
    # target 0.62 first met at evaluation 3 (t = 5.4): steady = 5.4 - 5.0
    assert row["tta_s"] == pytest.approx(5.4) and row["first_step_s"] == pytest.approx(5.0)
    assert row["tta_steady_s"] == pytest.approx(0.4) and row["startup_s"] == 7.5
    assert row["repeat"] == 1
    cols = report.RUN_COLUMNS
    assert cols.index("tta_steady_s") == cols.index("tta_s") + 1 and cols.index("startup_s") == cols.index("tta_s") + 2
    text = report_table.format_table([row], NET)
    header = text.splitlines()[3]
    assert "TTA s  steady TTA s  start s" in header and "steady TTA = clock from the end" in text
    assert " 5.4           0.4      7.5" in text.splitlines()[5]
    old = dict(row, startup_s=None)  # a sweep before start-up was recorded: the old columns
    assert "steady TTA" not in report_table.format_table([old], NET)


def test_interleave_orders_rounds_and_names_repeats():
    plan = tta.plan_runs(["digits"], ["none", "fp16"], ["fp16"])
    runs = tta.interleave(plan, 2)
    assert [r.run_id for r in runs] == [
        "digits-horovod-none-r1", "digits-horovod-fp16-r1", "digits-ddp-fp16-r1",
        "digits-horovod-none-r2", "digits-horovod-fp16-r2", "digits-ddp-fp16-r2"]
    assert [r.repeat for r in runs] == [1, 1, 1, 2, 2, 2] and runs[2].label == "DDP fp16_compress_hook"
    assert [r.run_id for r in tta.interleave(plan, 1)] == [r.run_id for r in plan]  # no suffix
    with pytest.raises(ValueError, match="--repeats must be an integer >= 1, got 0"):
        tta.interleave(plan, 0)
    args = tta_sweep.build_parser().parse_args(["--compressors", "fp16", "--ddp-hooks", "off", "--repeats", "3"])
    assert [r.run_id for r in tta_sweep.plan_sweep(args).runs] == [
        f"digits-horovod-{row}-r{k}" for k in (1, 2, 3) for row in ("fp16", "none-nocomm")]
    assert tta_sweep.build_parser().parse_args([]).repeats == 1


def _repeated_rows():
    """fp16 at 0.2/0.3/0.1 s per step and topkc at 0.1/0.1/0.25, 3 rounds, interleaved; topkc's
    third repeat never reaches the target."""
    results = {}
    for k, (a, b) in enumerate([(0.2, 0.1), (0.3, 0.1), (0.1, 0.25)], start=1):
        for name, spec, step_s in (("fp16", "fp16", a), ("topkc", "topkc:ratio=0.1", b)):
            res = _fake_result(spec, step_s=step_s, payload=8000 if spec == "fp16" else 800)
            res["meta"].update(repeat=k, startup_s=4.0 + k)
            if name == "topkc" and k == 3:
                res["evals"]["metric"] = [0.5] * 10
            results[f"a-horovod-{name}-r{k}"] = res
    rows = report.add_baseline_ratios([report.summarize(k, v, NET) for k, v in results.items()])
    return rows, results


def test_aggregate_medians_spread_and_ratios_from_medians():
    rows, _ = _repeated_rows()
    assert [r["repeat"] for r in rows] == [1, 1, 2, 2, 3, 3] and report.repeated(rows)
    fp16, topkc = report.aggregate(rows)
    assert fp16["run_id"] == "a-horovod-fp16" and fp16["repeats"] == 3 and fp16["repeat"] is None
    # fp16 TTA = 3 steps' clock: 0.6, 0.9, 0.3 -> median 0.6, min 0.3, max 0.9
    assert fp16["tta_s"] == pytest.approx(0.6)
    assert (fp16["tta_s_min"], fp16["tta_s_max"]) == (pytest.approx(0.3), pytest.approx(0.9))
    assert fp16["startup_s"] == 6.0 and (fp16["startup_s_min"], fp16["startup_s_max"]) == (5.0, 7.0)
    assert fp16["step_ms_median"] == pytest.approx(200) and fp16["tta_reached"] == 3
    # topkc: 0.3, 0.3, not reached (inf) -> median 0.3, max None ("nr")
    assert topkc["tta_s"] == pytest.approx(0.3) and topkc["tta_s_max"] is None and topkc["tta_reached"] == 2
    assert topkc["tta_steady_s"] == pytest.approx(0.2)  # 0.3 - the first step's 0.1
    assert topkc["tta_vs_fp16"] == pytest.approx(2.0)  # medians: 0.6 / 0.3
    assert topkc["fp16_bytes_ratio"] == pytest.approx(8040 / 840) and topkc["status"] == "ok"
    # half or more missing: not reached
    two = [r for r in rows if r["spec"] != "fp16" and r["repeat"] >= 2]
    assert report.aggregate(two)[0]["tta_s"] is None
    failed = dict(rows[0], status="failed (exit 1)")
    assert report.aggregate([failed, rows[2]])[0]["status"] == "1 of 2 failed"


def test_table_and_files_with_repeats(tmp_path):
    rows, results = _repeated_rows()
    text = report_table.format_table(rows, NET)
    lines = text.splitlines()
    assert "Each row: 3 repeats" in lines[1] and "min-max" in lines[1]
    assert "TTA s median (min-max)" in lines[3] and len(lines) == 7  # 2 rows, not 6
    assert "0.6 (0.3-0.9)" in lines[5] and "0.3 (0.3-nr)" in lines[6] and "6.0 (5.0-7.0)" in lines[5]
    assert "2.00x" in lines[6]
    md = report_table.markdown_table(rows, NET)
    assert md.count("\n| ") == 3
    summary = report.aggregate(rows)
    report.write_csvs(str(tmp_path), rows, results)
    report.write_summary_csv(str(tmp_path / "summary.csv"), summary)
    report.write_json(str(tmp_path / "results.json"), {"network": NET}, rows, results, summary)
    with open(tmp_path / "runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert [r["repeat"] for r in runs] == ["1", "1", "2", "2", "3", "3"]
    with open(tmp_path / "summary.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == report.SUMMARY_COLUMNS
        summ = list(reader)
    assert [s["run_id"] for s in summ] == ["a-horovod-fp16", "a-horovod-topkc"]
    assert float(summ[0]["tta_s_max"]) == pytest.approx(0.9) and summ[1]["tta_s_max"] == ""
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["runs"]) == 6 and len(data["summary"]) == 2
    path = report_plot.plot(str(tmp_path / "p.png"), rows, results, "digits", NET)
    assert os.path.getsize(path) > 10_000


def test_plot_rows_by_workload_not_by_id_prefix():
    """``digits``'s plot never takes the ``digits-tf`` runs of the same sweep, and ``digits-tf``'s
    takes them as the TF worker records them (workload ``digits``, framework ``tensorflow``)."""
    rows = [{"run_id": "digits-horovod-fp16", "workload": "digits", "framework": "torch"},
            {"run_id": "digits-tf-horovod-fp16", "workload": "digits", "framework": "tensorflow"},
            {"run_id": "digits-tf-horovod-thc", "workload": "digits-tf"},
            {"run_id": "digits-horovod-thc"},  # an old record without the field: by its id
            {"run_id": "digits-horovod-none", "workload": "digits"}]
    results = {"digits-horovod-fp16": {"evals": [1]}, "digits-tf-horovod-fp16": {"evals": [1]},
               "digits-tf-horovod-thc": {"evals": [1]},
               "digits-horovod-thc": {"evals": [1]}, "digits-horovod-none": {"evals": []}}
    assert [r["run_id"] for r in report_plot.plot_rows(rows, results, "digits")] == \
        ["digits-horovod-fp16", "digits-horovod-thc"]
    assert [r["run_id"] for r in report_plot.plot_rows(rows, results, "digits-tf")] == \
        ["digits-tf-horovod-fp16", "digits-tf-horovod-thc"]
    assert [report.workload_name(r) for r in rows[:3]] == ["digits", "digits-tf", "digits-tf"]


# ---- the no-communication reference ----

def test_plan_adds_one_no_comm_reference_per_workload():
    plan = tta.plan_runs(["digits", "digits-tf"], ["none", "fp16"], ["fp16"], reference=True)
    assert [r.run_id for r in plan] == [
        "digits-horovod-none", "digits-horovod-fp16", "digits-ddp-fp16", "digits-horovod-none-nocomm",
        "digits-tf-horovod-none", "digits-tf-horovod-fp16", "digits-tf-horovod-none-nocomm"]
    ref = plan[3]
    assert ref.reference and ref.system == "horovod" and ref.spec == tta.NOCOMM_SPEC == "none"
    assert ref.label == tta.NOCOMM_LABEL == "no communication (reference: fp32, unthrottled)"
    assert not any(r.reference for r in plan if not r.run_id.endswith("-nocomm"))
    assert plan[0].label == "fp32 (none)"  # the FP32 competitor row keeps its own label
    # The same training as the FP32 row: the same worker command.
    args = tta_sweep.build_parser().parse_args([])
    assert tta_run.command(ref, args, "o.json") == tta_run.command(plan[0], args, "o.json")
    # Repeats keep the flag and name the rounds as for every row.
    runs = tta.interleave(plan[:4], 2)
    assert [r.run_id for r in runs if r.reference] == ["digits-horovod-none-nocomm-r1", "digits-horovod-none-nocomm-r2"]
    assert all(r.label == tta.NOCOMM_LABEL for r in runs if r.reference)
    # In the sweep by default, after every other row of its workload; off on request.
    args = tta_sweep.build_parser().parse_args(["--compressors", "fp16", "--ddp-hooks", "off"])
    assert [r.run_id for r in tta_sweep.plan_sweep(args).runs] == ["digits-horovod-fp16", "digits-horovod-none-nocomm"]
    assert args.no_comm_reference == "on"  # the default, filled in by plan_sweep
    args = tta_sweep.build_parser().parse_args(["--compressors", "fp16", "--ddp-hooks", "off", "--no-comm-reference", "off"])
    assert [r.run_id for r in tta_sweep.plan_sweep(args).runs] == ["digits-horovod-fp16"]


def test_reference_runs_on_an_unthrottled_loopback_link():
    from hvd_gradcomp.bench import netem
    net = netem.EmulatedNetwork(2, netem.LinkConfig(500))  # not set up: only its identity counts
    plan = tta.plan_runs(["digits"], ["none"], ["fp16"], reference=True)
    assert tta_run.network_for(net, plan[0]) is net and tta_run.network_for(net, plan[1]) is net
    own = tta_run.network_for(net, plan[2])
    assert isinstance(own, netem.LoopbackNetwork) and own.world_size == 2
    d = own.describe()
    assert d["mode"] == "loopback" and d["bandwidth_mbit"] is None and "no-communication reference" in d["note"]
    stub = tta_run.stub_result(plan[2], "timeout", "", d)
    assert stub["meta"]["reference"] is True and stub["network"]["mode"] == "loopback"
    assert "network" not in tta_run.stub_result(plan[0], "timeout") and \
        tta_run.stub_result(plan[0], "timeout")["meta"]["reference"] is False


def _reference_result(step_s=0.05, final=None):
    res = _fake_result("none", step_s=step_s, payload=16000)
    res["bytes_per_step"]["side"] = res["bytes_per_step"]["side_collectives"] = 0
    res["meta"].update(reference=True, label=tta.NOCOMM_LABEL)
    res["network"] = {"mode": "loopback", "bandwidth_mbit": None, "latency_ms": None,
                      "note": "LOOPBACK: no rate limit, communication nearly free (no-communication reference)"}
    if final is not None:
        res["evals"]["metric"][-1] = final
    return res


def test_reference_row_is_never_a_baseline_or_best():
    results = {"a-fp16": _fake_result("fp16", step_s=0.2), "a-none": _fake_result("none", step_s=0.4, payload=16000),
               "a-ddp": _fake_result("ddp:fp16", system="ddp", step_s=0.3),
               "a-nocomm": _reference_result(step_s=0.05, final=0.99)}
    rows = report.add_baseline_ratios([report.summarize(k, v, NET, "abc") for k, v in results.items()])
    fp16, fp32, ddp, ref = rows
    assert [r["reference"] for r in rows] == [False, False, False, True]
    # Network columns: the reference's own link, the others the sweep's.
    assert ref["network_mode"] == "loopback" and ref["bandwidth_mbit"] is None
    assert fp32["network_mode"] == "netns" and fp32["bandwidth_mbit"] == 500.0
    # TTA: 3 evaluations' clock: fp16 0.6, fp32 1.2, ddp 0.9, reference 0.15 (the fastest).
    assert ref["tta_s"] == pytest.approx(0.15)
    # Its own ratios (the most any compressor could gain) ...
    assert ref["tta_vs_fp16"] == pytest.approx(4.0) and ref["tta_vs_best_ddp"] == pytest.approx(6.0)
    # ... but the best DDP row is still DDP's, and FP16 still the FP16 run.
    assert fp32["tta_vs_best_ddp"] == pytest.approx(0.9 / 1.2) and fp32["tta_vs_fp16"] == pytest.approx(0.5)
    assert fp16["tta_vs_fp16"] == pytest.approx(1.0)
    # Neither a fake "fp16" reference nor a "ddp" reference would be taken as a baseline.
    odd = [dict(ref, spec="fp16", system="horovod", tta_s=0.01, bytes_per_step=1),
           dict(ref, system="ddp", tta_s=0.01), dict(fp16), dict(ddp)]
    report.add_baseline_ratios(odd)
    assert odd[2]["tta_vs_fp16"] == pytest.approx(1.0) and odd[3]["tta_vs_best_ddp"] == pytest.approx(1.0)
    # The plots' FP32 level is the FP32 row's, not the reference's (also spec "none").
    assert fp32["final_metric"] != ref["final_metric"] == pytest.approx(0.99)
    assert report_plot.converged_levels(rows) == {"FP16": fp16["final_metric"], "FP32": fp32["final_metric"]}
    assert report_plot.converged_levels([ref]) == {}


def test_reference_in_table_aggregate_and_plot(tmp_path):
    results = {}
    for k in (1, 2):
        for name, res in (("none", _fake_result("none", step_s=0.4, payload=16000)), ("nocomm", _reference_result(0.1))):
            res["meta"]["repeat"] = k
            results[f"a-horovod-{name}-r{k}"] = res
    rows = report.add_baseline_ratios([report.summarize(k, v, NET) for k, v in results.items()])
    summary = report.aggregate(rows)  # FP32 and the reference share spec "none" but not a row
    assert [(s["run_id"], s["reference"], s["repeats"]) for s in summary] == [
        ("a-horovod-none", False, 2), ("a-horovod-nocomm", True, 2)]
    assert summary[1]["tta_s"] == pytest.approx(0.3) and summary[1]["network_mode"] == "loopback"
    text = report_table.format_table(rows, NET)
    assert text.splitlines()[0].startswith("Network: emulated: 500 Mbit/s")  # the sweep's
    assert "The no-communication row is a reference, not a competitor" in text.splitlines()[1]
    assert tta.NOCOMM_LABEL in text.splitlines()[-1] and "0.3 (0.3-0.3)" in text.splitlines()[-1]
    single = [r for r in rows if r["repeat"] == 1]
    md = report_table.markdown_table(single, NET)
    assert f"| digits | {tta.NOCOMM_LABEL} | 0.3 |" in md and md.count("\n| ") == 3
    assert "reference, not a competitor" not in report_table.format_table(single[:1], NET)
    report.write_csvs(str(tmp_path), rows, results)
    with open(tmp_path / "runs.csv") as f:
        assert [r["reference"] for r in csv.DictReader(f)] == ["False", "True", "False", "True"]
    path = report_plot.plot(str(tmp_path / "p.png"), rows, results, "digits", NET)
    assert os.path.getsize(path) > 10_000


def test_auto_rows_show_what_each_tensor_ended_on():
    res = _fake_result("auto")
    res["bytes_per_step"]["choices"] = {"fc2.weight": "powersgd:rank=4", "fc1.weight": "fp16"}
    row = report.summarize("a", res, NET)
    assert row["choices"] == "fc1.weight: fp16; fc2.weight: powersgd:rank=4"
    assert "auto (digits) ended on: fc1.weight: fp16; fc2.weight: powersgd:rank=4" in \
        report_table.format_table([row], NET).splitlines()[-1]
    assert report_table.markdown_table([row], NET).endswith("fc2.weight: powersgd:rank=4")
    plain = report.summarize("b", _fake_result("fp16"), NET)
    assert plain["choices"] is None and "ended on" not in report_table.format_table([plain], NET)


def test_auto_choices_over_time_segments_plot_and_publish(tmp_path):
    """An auto run's decision history becomes per-tensor segments of steps (a decision at
    probe step p, counted from 0, applies from training step p + 2), a plot beside the TTA
    plot, and a link in the published block; runs without decisions get none."""
    res = _fake_result("auto")  # 10 training steps
    res["bytes_per_step"]["choices"] = {"fc2.weight": "topkc:ratio=0.1", "fc1.weight": "fp16"}
    res["bytes_per_step"]["decisions"] = [
        {"key": "fc2.weight", "step": 2, "scheme": "topkc:ratio=0.1", "reason": "least predicted time",
         "predicted_ms": {"fp16": 80.0, "topkc:ratio=0.1": 45.0}, "errors": {"fp16": 0.0, "topkc:ratio=0.1": 0.9}},
        {"key": "fc1.weight", "step": 2, "scheme": "fp16", "reason": "least predicted time (unchanged)",
         "predicted_ms": {"fp16": 2.0, "topkc:ratio=0.1": 6.0}, "errors": {"fp16": 0.0, "topkc:ratio=0.1": 0.9}},
        {"key": "fc2.weight", "step": 6, "scheme": "fp16", "reason": "current choice over the error budget",
         "predicted_ms": {"fp16": 80.0, "topkc:ratio=0.1": 45.0}, "errors": {"fp16": 0.0, "topkc:ratio=0.1": 0.99}}]
    assert report_plot.choice_segments(res) == {
        "fc1.weight": [(1, 10, "fp16")],
        "fc2.weight": [(1, 3, "fp16"), (4, 7, "topkc:ratio=0.1"), (8, 10, "fp16")]}
    results = {"digits-horovod-auto": res, "digits-horovod-fp16": _fake_result("fp16")}
    rows = [report.summarize(k, v, NET) for k, v in results.items()]
    assert [r["run_id"] for r in report_plot.choice_rows(rows, results, "digits")] == ["digits-horovod-auto"]
    path = report_plot.plot_choices(report_plot.choices_plot_path(str(tmp_path), "digits"),
                               report_plot.choice_rows(rows, results, "digits"), results, "t")
    assert path.endswith("auto_digits.png") and os.path.getsize(path) > 1000
    sweep = {"network": dict(NET, world_size=2), "workloads": ["digits"], "date": "d", "git_commit": "c", "argv": [],
             "cpu_count": 2, "elapsed_s": 60.0, "link_check": None}
    block = publish.render_block(sweep, rows, results, str(tmp_path), str(tmp_path / "doc.md"))
    assert "![auto_digits.png](auto_digits.png)" in block and "![tta_digits.png](tta_digits.png)" in block
    del res["bytes_per_step"]["decisions"]
    assert report_plot.choice_rows(rows, results, "digits") == []
