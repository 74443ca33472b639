"""``python -m hvd_gradcomp.bench publish``: the results block re-rendered from a saved sweep."""
import json
import os
import re
import shutil
import subprocess
import sys

from hvd_gradcomp.bench import publish, report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _block(text, name):
    start, end = f"<!-- {name}:start -->\n", f"\n<!-- {name}:end -->"
    return text[text.index(start) + len(start):text.index(end)]


def _sweep(workloads=("digits",)):
    """A two-run sweep as ``results.json`` holds it (fp16 and topkc of workload ``digits``)."""
    net = {"mode": "netns", "bandwidth_mbit": 500.0, "latency_ms": 0.0, "world_size": 2,
           "note": "emulated: 500 Mbit/s per worker link", "qdisc": "tbf rate 500mbit"}

    def result(spec, step_s, payload):
        n = 6
        return {"status": "ok", "bytes_per_step": {"payload": payload, "side": 0, "side_collectives": 0},
                "meta": {"workload": "digits", "framework": "torch", "system": "horovod", "label": spec,
                         "compression": spec, "window": 1, "higher_is_better": True, "target": 0.6,
                         "world_size": 2},
                "steps": {"step": list(range(1, n + 1)), "epoch": [0.5 * i for i in range(1, n + 1)],
                          "t": [step_s * i for i in range(1, n + 1)], "compute_s": [step_s / 2] * n,
                          "codec_s": [0.0] * n, "comm_s": [step_s / 2] * n, "loss": [1.0] * n},
                "evals": {"step": list(range(n)), "epoch": [0.5 * i for i in range(n)],
                          "t": [step_s * i for i in range(n)], "metric": [0.5 + 0.05 * i for i in range(n)]}}

    results = {"digits-horovod-fp16": result("fp16", 0.2, 8000), "digits-horovod-topkc": result("topkc:ratio=0.1", 0.1, 800)}
    rows = report.add_baseline_ratios([report.summarize(k, v, net, "abc123") for k, v in results.items()])
    sweep = {"date": "2026-12-01T10:00:00", "argv": ["--out", "x"], "git_commit": "abc123", "cpu_count": 4,
             "network": net, "workloads": list(workloads), "elapsed_s": 180.0,
             "link_check": {"nbytes": 30 * 2 ** 20, "seconds": 0.6, "model_seconds": 0.5, "ratio": 1.2}}
    return sweep, rows, results


def _write_run(folder):
    sweep, rows, results = _sweep()
    os.makedirs(folder, exist_ok=True)
    report.write_json(os.path.join(folder, "results.json"), sweep, rows, results)
    return sweep, rows, results


def test_block_from_saved_results(tmp_path):
    run = tmp_path / "runs" / "r1"
    sweep, rows, _ = _write_run(str(run))
    doc = tmp_path / "README.md"
    doc.write_text("intro\n<!-- demo:start -->\nold\n<!-- demo:end -->\noutro\n")
    assert publish.main(["--results", str(run / "results.json"), "--update-doc", str(doc),
                         "--doc-block", "demo"]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n<!-- demo:start -->\n") and text.endswith("<!-- demo:end -->\noutro\n")
    block = _block(text, "demo")
    assert block.startswith("Network: emulated: 500 Mbit/s per worker link (tbf rate 500mbit)")
    # Both reach 0.6 at their fourth evaluation (the third one's rolling mean is 0.5999...):
    # topkc at t = 0.3 s, fp16 at 0.6 s: 2.00x; bytes 8000 / 800: 10.00x.
    assert "| digits | topkc:ratio=0.1 | 0.3 | 2.00x | - | 3 (1.00x) | 2.00x | 75.0% | 6 | 100 | 0.001 | 10.00x |" in block
    assert "![tta_digits.png](runs/r1/tta_digits.png)" in block  # relative to the doc
    assert block.endswith(
        "Run of 2026-12-01T10:00:00 at commit `abc123`: 2 runs in 3.0 min, 2 workers, 4 cores; "
        "command `python -m hvd_gradcomp.bench tta --out x`. Link check: a 30 MiB all-reduce took "
        "0.600 s against 0.500 s for the ring model (ratio 1.20).")
    # The run folder is accepted too, and publishing again changes nothing.
    assert publish.main(["--results", str(run), "--update-doc", str(doc), "--doc-block", "demo"]) == 0
    assert doc.read_text() == text


def test_block_is_what_tta_writes(tmp_path):
    """tta --update-doc publishes from the saved results.json: the block rendered from the
    sweep's own data equals the one rendered from the file."""
    sweep, rows, results = _write_run(str(tmp_path / "r"))
    doc = str(tmp_path / "d.md")
    live = publish.render_block(sweep, rows, results, str(tmp_path / "r"), doc)
    data, out_dir = publish.load_results(str(tmp_path / "r"))
    assert out_dir == str(tmp_path / "r")
    assert publish.render_block(data["sweep"], data["runs"], data["results"], out_dir, doc) == live


def test_no_plot_without_evaluations_and_loopback_without_link_line(tmp_path):
    sweep, rows, results = _sweep(workloads=("digits", "b"))  # no run of workload b
    sweep["link_check"] = {"nbytes": 1, "seconds": 0.1, "model_seconds": None}
    block = publish.render_block(sweep, rows, results, str(tmp_path), str(tmp_path / "d.md"))
    assert "![tta_digits.png](tta_digits.png)" in block and "tta_b.png" not in block
    assert block.endswith("command `python -m hvd_gradcomp.bench tta --out x`.")


def test_errors_exit_2_and_leave_the_doc(tmp_path, capsys):
    _write_run(str(tmp_path / "r"))
    doc = tmp_path / "d.md"
    doc.write_text("no markers here\n")
    assert publish.main(["--results", str(tmp_path / "r"), "--update-doc", str(doc)]) == 2
    assert "expected the markers <!-- tta-demo:start -->" in capsys.readouterr().err
    assert doc.read_text() == "no markers here\n"
    assert publish.main(["--results", str(tmp_path / "missing.json"), "--update-doc", str(doc)]) == 2
    (tmp_path / "bad.json").write_text(json.dumps({"runs": []}))
    assert publish.main(["--results", str(tmp_path / "bad.json")]) == 2
    assert "lacks ['sweep', 'results']" in capsys.readouterr().err


def test_without_doc_prints_the_block(tmp_path, capsys, monkeypatch):
    _write_run(str(tmp_path / "r"))
    monkeypatch.chdir(tmp_path)
    assert publish.main(["--results", "r/results.json"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Network: emulated") and "![tta_digits.png](r/tta_digits.png)" in out


def test_committed_demo_block_is_reproduced_from_its_results(tmp_path):
    """docs/tta.md's tta-demo block is exactly what publish renders from docs/tta-demo/results.json
    (run as the CLI, on a copy, so re-rendering needs no sweep and the block was not hand-edited)."""
    shutil.copytree(os.path.join(ROOT, "docs", "tta-demo"), tmp_path / "docs" / "tta-demo",
                    ignore=shutil.ignore_patterns("logs", "runs", "*.csv"))
    page = os.path.join(ROOT, "docs", "tta.md")
    (tmp_path / "docs" / "tta.md").write_text(re.sub(r"(<!-- tta-demo:start -->\n).*?(\n<!-- tta-demo:end -->)",
                                                     r"\1stale\2", open(page).read(), flags=re.S))
    res = subprocess.run([sys.executable, "-m", "hvd_gradcomp.bench", "publish", "--results",
                          "docs/tta-demo/results.json", "--update-doc", "docs/tta.md"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "docs" / "tta.md").read_text() == open(page).read()


def test_block_with_the_no_comm_reference(tmp_path):
    """A sweep with the no-communication reference: its row, its own link in runs, the
    sentence saying it is a reference; FP16 stays the baseline of the other rows."""
    sweep, rows, results = _sweep()
    ref = json.loads(json.dumps(results["digits-horovod-fp16"]))
    ref["meta"].update(compression="none", label="no communication (reference: fp32, unthrottled)",
                       reference=True)
    ref["bytes_per_step"]["payload"] = 16000
    ref["steps"]["t"] = [0.04 * i for i in range(1, 7)]
    ref["steps"]["compute_s"] = ref["steps"]["comm_s"] = [0.02] * 6
    ref["evals"]["t"] = [0.04 * i for i in range(6)]
    ref["network"] = {"mode": "loopback", "bandwidth_mbit": None, "latency_ms": None, "world_size": 2,
                      "note": "LOOPBACK: no rate limit, communication nearly free (no-communication reference)"}
    results["digits-horovod-none-nocomm"] = ref
    rows.append(report.summarize("digits-horovod-none-nocomm", ref, sweep["network"], "abc123"))
    report.add_baseline_ratios(rows)
    run = tmp_path / "r"
    os.makedirs(run)
    report.write_json(str(run / "results.json"), sweep, rows, results)
    doc = tmp_path / "d.md"
    doc.write_text("<!-- tta-demo:start -->\n<!-- tta-demo:end -->\n")
    assert publish.main(["--results", str(run), "--update-doc", str(doc)]) == 0
    block = _block(doc.read_text(), "tta-demo")
    assert block.startswith("Network: emulated: 500 Mbit/s")  # the sweep's link, not the reference's
    assert "The no-communication row is a reference, not a competitor" in block
    # fp16 0.6 s, topkc 0.3 s (2.00x) as before; the reference 0.12 s: 5.00x, 16 kB (0.50x).
    assert "| digits | topkc:ratio=0.1 | 0.3 | 2.00x | - | 3 (1.00x) | 2.00x | 75.0% | 6 | 100 | 0.001 | 10.00x |" in block
    assert "| digits | no communication (reference: fp32, unthrottled) | 0.1 | 5.00x | - | 3 (1.00x) | 5.00x | 75.0% | 6 | 40 | 0.016 | 0.50x | 50% | 0% | 50% |" in block
    assert "3 runs in 3.0 min" in block
    data, _ = publish.load_results(str(run))
    assert [(r["reference"], r["network_mode"]) for r in data["runs"]] == [
        (False, "netns"), (False, "netns"), (True, "loopback")]
