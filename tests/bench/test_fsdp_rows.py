"""The harness's FSDP rows, without training (the end-to-end sweep: test_fsdp_smoke.py).

Parsing ``--fsdp-hooks`` and ``--fsdp-mesh``, planning (FP16-FSDP first, the worker's command,
the hosts of the network), targets and ratios against FP16-FSDP only, the stop flags of the
FSDP rows, the table's note, the worker's codec timer and byte count, and the emulated network's
hosts of several ranks (addresses, namespaces; the rate split itself is measured in the smoke
test).
"""
import re

import pytest

from hvd_gradcomp.bench import netem, report, report_plot, report_table, tta, tta_hooks, tta_run, tta_sweep


def _plan(*argv):
    args = tta_sweep.build_parser().parse_args(list(argv))
    return tta_sweep.plan_sweep(args), args


# ---- options ----

def test_parse_fsdp_hooks_puts_fp16_fsdp_first():
    assert tta_hooks.parse_fsdp_hooks("thc; topkc:ratio=0.1 ;fp16; fp32 with rs=thc; thc with overlap; "
                                      "thc with delay(1); thc with delay(1) with rs=fp16", 2) == [
        ("fp16", None, False, 0), ("thc", None, False, 0), ("topkc:ratio=0.1", None, False, 0),
        ("none", "thc", False, 0), ("thc", None, True, 0), ("thc", None, False, 1), ("thc", "fp16", False, 1)]
    assert tta_hooks.parse_fsdp_hooks("off") == [] and tta_hooks.parse_fsdp_hooks(" ") == []


def test_parse_fsdp_hooks_adds_the_missing_baseline(capsys):
    assert tta_hooks.parse_fsdp_hooks("thc with rs=signsgd", 2) == [("fp16", None, False, 0), ("thc", "signsgd", False, 0)]
    assert "FP16-FSDP ('fp16'), their baseline, added first" in capsys.readouterr().err


@pytest.mark.parametrize("text, shards, words", [
    ("nosuch", 2, "unknown compressor 'nosuch'"),
    ("topkc:ratio=0.1,selection=current", 2, "blocking two-round variant"),
    ("thc with rs=topkc:ratio=0.1", 2, "rs=topkc:ratio=0.1 routes tensors to topkc:ratio=0.1, which cannot be reduce-scattered"),
    ("thc with rs=powersgd:rank=4", 2, "cannot be reduce-scattered"),
    ("thc with rs=thc", 1, "one shard per replica"),
    ("thc with ar=thc", 2, "expected 'SPEC', 'SPEC with rs=SPEC', 'SPEC with overlap' or 'SPEC with delay(1)'"),
    ("thc with rs=thc with rs=fp16", 2, "expected 'SPEC', 'SPEC with rs=SPEC', 'SPEC with overlap'"),
    ("thc with delay(2)", 2, "delay(D) takes D = 1"),
    ("thc with delay(1) with delay(1)", 2, "got clause 'delay(1)'"),
    ("fp16 with delay(1)", 2, "delay(1) installs our hook with delay=1; 'fp16' is FSDP's own all-reduce"),
    ("thc with delay(1) with overlap", 2, "delay(1) and overlap together"),
    ("thc with overlap with overlap", 2, "got clause 'overlap'"),
    ("fp16 with overlap", 2, "'fp16' is FSDP's own all-reduce"),
    ("thc; thc", 2, "given twice"),
])
def test_parse_fsdp_hooks_rejects(text, shards, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        tta_hooks.parse_fsdp_hooks(text, shards)


@pytest.mark.parametrize("text, workers, expect", [
    (None, 4, (2, 2)), ("", 8, (2, 4)), ("2x2", 4, (2, 2)), ("4X1", 4, (4, 1)), (" 3x2 ", 6, (3, 2)),
    ("3x2", 4, "3 x 2 = 6 ranks, but --workers is 4"),
    ("1x4", 4, "at least 2 replicas"),
    ("2x", 4, "expected RxS"), ("twoxtwo", 4, "expected RxS"), ("2x0", 4, "expected RxS"),
    (None, 3, "needs an even --workers"),
])
def test_parse_fsdp_mesh(text, workers, expect):
    if isinstance(expect, tuple):
        assert tta_hooks.parse_fsdp_mesh(text, workers) == expect
    else:
        with pytest.raises(ValueError, match=expect):
            tta_hooks.parse_fsdp_mesh(text, workers)


# ---- the plan ----

def test_plan_fsdp_rows_beside_horovod_and_ddp(tmp_path):
    plan, args = _plan("--workloads", "lm,digits", "--compressors", "fp16", "--ddp-hooks", "fp16",
                       "--fsdp-hooks", "thc; fp16 with rs=thc; thc with overlap; thc with delay(1)", "--workers", "4",
                       "--fsdp-mesh", "2x2", "--no-comm-reference", "off", "--out", str(tmp_path))
    lm = [(r.system, r.spec, r.reduce_scatter, r.label, r.run_id) for r in plan.runs if r.workload == "lm"]
    assert lm == [("horovod", "fp16", None, "fp16", "lm-horovod-fp16"),
                  ("ddp", "fp16", None, "DDP fp16_compress_hook", "lm-ddp-fp16"),
                  ("fsdp", "fp16", None, "FP16-FSDP", "lm-fsdp-fp16"),
                  ("fsdp", "thc", None, "thc on FSDP", "lm-fsdp-thc"),
                  ("fsdp", "fp16", "thc", "FP16-FSDP, rs thc", "lm-fsdp-fp16-with-rs-thc"),
                  ("fsdp", "thc", None, "thc on FSDP, overlap", "lm-fsdp-thc-with-overlap"),
                  ("fsdp", "thc", None, "thc on FSDP, delay(1)", "lm-fsdp-thc-with-delay-1")]
    assert "--overlap" in tta_run.command(plan.runs[5], args, "/tmp/x.json")
    assert "--overlap" not in tta_run.command(plan.runs[3], args, "/tmp/x.json")
    delayed = tta_run.command(plan.runs[6], args, "/tmp/x.json")
    assert delayed[delayed.index("--delay") + 1] == "1" and "--delay" not in tta_run.command(plan.runs[3], args, "/tmp/x.json")
    assert tta_run.stub_result(plan.runs[6], "failed")["meta"]["compression"] == "fsdp:thc with delay(1)"
    # digits takes no FSDP rows; the network: one host per replica (its 2 shards share it)
    assert {r.system for r in plan.runs if r.workload == "digits"} == {"horovod", "ddp"}
    assert plan.fsdp_mesh == (2, 2) and plan.ranks_per_host == 2
    cmd = tta_run.command(plan.runs[4], args, "/tmp/x.json")
    assert cmd[1:3] == ["-m", "hvd_gradcomp.bench.workers.fsdp_torch"]
    i = cmd.index("--workload")
    assert cmd[i:i + 8] == ["--workload", "lm", "--compression", "fp16", "--mesh", "2x2",
                            "--reduce-scatter", "thc"]


def test_plan_fsdp_options_and_errors(tmp_path):
    plan, _ = _plan("--workloads", "lm-comm", "--compressors", "off", "--fsdp-hooks", "thc", "--workers", "8",
                    "--out", str(tmp_path))
    assert [r.label for r in plan.runs] == ["FP16-FSDP", "thc on FSDP"]
    assert plan.fsdp_mesh == (2, 4) and plan.ranks_per_host == 4
    plan, _ = _plan("--workloads", "lm-comm", "--compressors", "off", "--fsdp-hooks", "thc", "--workers", "4",
                    "--ranks-per-host", "1", "--out", str(tmp_path))
    assert plan.ranks_per_host == 1  # every rank its own slow link, on request
    plan, _ = _plan("--compressors", "fp16", "--ddp-hooks", "off", "--out", str(tmp_path))
    assert plan.fsdp_mesh is None and plan.ranks_per_host == 1
    for argv, words in (
            (["--workloads", "digits", "--fsdp-hooks", "thc", "--workers", "4"], "FSDP rows run on lm, lm-comm only"),
            (["--workloads", "lm", "--fsdp-hooks", "thc", "--workers", "4", "--fsdp-mesh", "4x2"], "the workers must divide"),
            (["--workloads", "lm", "--fsdp-mesh", "2x2", "--workers", "4"], "give --fsdp-hooks too"),
            (["--workloads", "lm", "--fsdp-hooks", "thc", "--workers", "4", "--ranks-per-host", "3"],
             "--ranks-per-host must be >= 1 and divide --workers 4"),
            (["--workloads", "lm-comm", "--compressors", "off"], "the sweep has no rows")):
        with pytest.raises(ValueError, match=words):
            _plan(*argv, "--out", str(tmp_path))


def test_fsdp_rows_stop_at_fp16_fsdps_target_not_horovods():
    stops = {}
    hvd_fp16, fsdp_fp16 = tta.RunSpec("lm-comm", "horovod", "fp16"), tta.RunSpec("lm-comm", "fsdp", "fp16")
    thc, rs = tta.RunSpec("lm-comm", "fsdp", "thc"), tta.RunSpec("lm-comm", "fsdp", "fp16", reduce_scatter="thc")

    def result(final):
        return {"status": "ok", "meta": {"target_vs_fp16": 1.02, "window": 1, "higher_is_better": False,
                                         "steps_run": 40},
                "evals": {"t": [0.0, 5.0, 10.0], "metric": [300.0, 2 * final, final]}, "steps": {"step": [1]}}

    tta_run.note_fp16(fsdp_fp16, result(10.0), stops)
    assert tta_run.stop_flags(tta.RunSpec("lm-comm", "horovod", "thc"), stops) == []  # Horovod's FP16 not yet run
    tta_run.note_fp16(hvd_fp16, result(20.0), stops)
    assert stops["lm-comm fsdp"]["target"] == pytest.approx(10.2) and stops["lm-comm"]["target"] == pytest.approx(20.4)
    assert stops["lm-comm fsdp"]["max_seconds"] == pytest.approx(15.0)  # 1.5 x FP16-FSDP's TTA (10 s)
    flags = tta_run.stop_flags(thc, stops)
    assert flags[:2] == ["--target", "10.2"] and flags[flags.index("--max-seconds") + 1] == "15"
    assert tta_run.stop_flags(rs, stops)[:2] == ["--target", "10.2"]  # rs rows are not the baseline
    assert tta_run.stop_flags(fsdp_fp16, stops) == []


# ---- the report ----

def _fake(run_id, spec, system, final, t_reach, payload, rs_bytes=None):
    metric = [300.0, 2 * final, final, final]
    return run_id, {"status": "ok",
                    "bytes_per_step": {"payload": payload, "side": 0, "side_collectives": 0,
                                       **({"reduce_scatter": rs_bytes, "mesh": [2, 2]} if rs_bytes else {})},
                    "meta": {"workload": "lm-comm", "framework": "torch", "system": system, "label": spec,
                             "compression": spec, "window": 1, "higher_is_better": False, "target": None,
                             "target_vs_fp16": 1.02, "world_size": 4, "mesh": "2x2" if system == "fsdp" else None},
                    "steps": {"step": [1, 2, 3], "epoch": [0.1, 0.2, 0.3], "t": [1.0, 2.0, 3.0],
                              "compute_s": [0.5] * 3, "codec_s": [0.1] * 3, "comm_s": [0.4] * 3, "loss": [1.0] * 3},
                    "evals": {"step": [0, 1, 2, 3], "epoch": [0, 0.1, 0.2, 0.3], "t": [0.0, 1.0, t_reach, 3.0],
                              "metric": metric}}


def test_fsdp_targets_and_ratios_against_fp16_fsdp(tmp_path):
    results = dict([_fake("h", "fp16", "horovod", 20.0, 2.0, 1000),
                    _fake("f", "fsdp:fp16", "fsdp", 10.0, 2.0, 500, 1000),
                    _fake("t", "fsdp:thc", "fsdp", 10.0, 1.0, 125, 1000)])
    rows = [report.summarize(k, v, {"mode": "netns", "note": "x"}) for k, v in results.items()]
    report.apply_targets(rows, results)
    report.add_baseline_ratios(rows)
    h, f, t = rows
    assert h["target"] == pytest.approx(20.4) and f["target"] == t["target"] == pytest.approx(10.2)
    assert t["tta_s"] == 1.0 and t["tta_vs_fp16"] == pytest.approx(2.0) and t["fp16_bytes_ratio"] == 4.0
    assert t["bytes_reduce_scatter"] == 1000 and t["mesh"] == "2x2" and h["mesh"] is None
    assert report_plot.converged_levels(rows) == {"FP16": 20.0, "FP16-FSDP": 10.0}
    table = report_table.format_table(rows, {"mode": "netns", "note": "x", "qdisc": "q"}, results)
    assert "FSDP rows: HSDP (FSDP2 fully_shard on a replicas x shards mesh, 2x2)" in table
    report_plot.plot(str(tmp_path / "p.png"), rows, results, "t", {"note": "x"})
    # Without FP16-FSDP the FSDP rows have no target: never Horovod's FP16 instead.
    del results["f"]
    rows = [report.summarize(k, v, {"mode": "netns"}) for k, v in results.items()]
    report.apply_targets(rows, results)
    assert rows[0]["target"] == pytest.approx(20.4) and rows[1]["target"] is None and rows[1]["tta_s"] is None


# ---- the worker's pieces ----

def test_codec_timer_counts_the_codec_calls():
    import torch
    from torch_backend import Compression
    from hvd_gradcomp.bench.workers.fsdp_torch import _shard_numel, native_spec, timed_compressor
    comp = Compression.from_spec("thc")
    ticks = iter(range(100))
    timer = timed_compressor(comp, lambda: float(next(ticks)))
    from hvd_gradcomp.codec import Codec
    assert isinstance(comp.codec, timer) and type(comp.codec).__mro__[1] is Codec
    for name in ("plan_bucket", "encode_unit", "decode", "decode_scattered"):
        try:  # each call takes one tick of the fake clock, failing or not
            getattr(comp.codec, name)(None, None)
        except Exception:
            pass
    assert timer.take() == 4.0 and timer.take() == 0.0
    assert comp.spec == "thc"  # the same object, its routing untouched
    assert native_spec("fp16") is torch.float16 and native_spec("fp32") is torch.float32
    assert native_spec("thc") is None
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7))  # weights [3,5], [7,3]
    # dim 0 padded to a multiple of S: S=2 -> 2x5 + 2 + 4x3 + 4
    assert _shard_numel(model, 2) == 10 + 2 + 12 + 4 and _shard_numel(model, 1) == 15 + 3 + 21 + 7


def test_hosts_of_several_ranks_share_an_address_and_a_namespace():
    net = netem.EmulatedNetwork(4, netem.LinkConfig(50), tag="t1", ranks_per_host=2)
    net.subnet = "10.231.9"  # set by setup(); nothing is created here
    assert net.hosts == 2 and len(net.namespaces) == len(net.veths) == 2
    assert net.addresses() == ["10.231.9.10", "10.231.9.10", "10.231.9.11", "10.231.9.11"]
    assert net.hostnames() == ["hgc-w0", "hgc-w0", "hgc-w1", "hgc-w1"]
    assert [net.wrap(r, ["x"])[3] for r in range(4)] == ["hgct1w0", "hgct1w0", "hgct1w1", "hgct1w1"]
    d = net.describe()
    assert d["ranks_per_host"] == 2 and "2 hosts of 2 ranks" in d["note"] and "ranks 0-1, 2-3" in d["note"]
    assert "per worker link" in netem.EmulatedNetwork(2, tag="t2").describe()["note"]
    for bad in (3, 0):
        with pytest.raises(ValueError, match="ranks_per_host must be an integer >= 1 dividing world_size 4"):
            netem.EmulatedNetwork(4, tag="t3", ranks_per_host=bad)
        with pytest.raises(ValueError, match="ranks_per_host"):
            netem.make_network(4, netem.LinkConfig(), loopback=True, ranks_per_host=bad)
