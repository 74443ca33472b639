"""Outputs of the time-to-accuracy harness: summaries, CSV/JSON, the table, the plots.

Definitions (all times are the training clock of rank 0: the sum of step times, evaluation
excluded, in seconds):

- rolling metric: the trailing mean of the last ``window`` evaluations;
- time-to-target (TTA): the clock at the first evaluation whose rolling metric reaches the
  target (>= for accuracy, <= for perplexity); empty when never reached;
- TTA vs FP16: FP16's TTA / this run's TTA, against the FP16 run of the same workload and
  system (Horovod-PyTorch, Horovod-TensorFlow, DDP), so > 1 means sooner than FP16;
- final metric: the rolling metric at the last evaluation;
- bytes/step: bytes each rank hands to all-reduces per step (payload + side collectives);
  FP16 bytes / ours is the compression against FP16;
- shares: compute, compress+decompress ("codec") and communication time as fractions of the
  training clock; "overhead share" is the codec share.
"""
import csv
import json
import math
import os
import statistics

from .worker import rolling_mean

__all__ = ["time_to_target", "summarize", "add_baseline_ratios", "RUN_COLUMNS", "STEP_COLUMNS",
           "EVAL_COLUMNS", "write_csvs", "write_json", "format_table", "markdown_table", "plot",
           "plot_rows", "plot_path", "update_doc"]

RUN_COLUMNS = [
    "run_id", "workload", "framework", "system", "label", "spec", "status", "stop_reason",
    "network_mode", "bandwidth_mbit", "latency_ms", "world_size", "seed", "params", "target",
    "higher_is_better", "steps", "epochs", "clock_s", "wall_s", "tta_s", "tta_vs_fp16", "tta_vs_best_ddp",
    "final_metric", "best_metric", "bytes_payload", "bytes_side", "side_collectives",
    "bytes_per_step", "fp16_bytes_ratio", "step_ms_median", "compute_share", "codec_share",
    "comm_share", "git_commit", "versions",
]
STEP_COLUMNS = ["run_id", "step", "epoch", "t", "compute_s", "codec_s", "comm_s", "loss"]
EVAL_COLUMNS = ["run_id", "step", "epoch", "t", "metric", "rolling"]


def time_to_target(t, metric, target, higher_is_better=True, window=5):
    """Clock of the first evaluation whose trailing rolling mean reaches ``target``; None if none.

    Args:
        t: clock of each evaluation (seconds, non-decreasing).
        metric: metric of each evaluation (same length).
        target: the threshold; reached when rolling >= target (higher_is_better) or <= target.
        window: evaluations in the rolling mean (>= 1).

    Raises:
        ValueError: ``t`` and ``metric`` differ in length, or window < 1.
    """
    if len(t) != len(metric):
        raise ValueError(f"time_to_target: expected t and metric of equal length, got {len(t)} and {len(metric)}")
    if window < 1:
        raise ValueError(f"time_to_target: window must be >= 1, got {window}")
    for when, roll in zip(t, rolling_mean(list(metric), window)):
        if (roll >= target) if higher_is_better else (roll <= target):
            return when
    return None


def summarize(run_id, result, network, git_commit=None):
    """One summary row (dict with :data:`RUN_COLUMNS`) from a worker's JSON result.

    ``result`` may be a failed run: ``{"meta": {...}, "status": "failed: ..."}`` with no records.
    """
    meta = result.get("meta", {})
    steps = result.get("steps") or {}
    evals = result.get("evals") or {}
    wire = result.get("bytes_per_step") or {}
    window = int(meta.get("window", 5))
    higher = bool(meta.get("higher_is_better", True))
    row = {c: None for c in RUN_COLUMNS}
    row.update(run_id=run_id, workload=meta.get("workload"), framework=meta.get("framework"),
               system=meta.get("system"), label=meta.get("label"), spec=meta.get("compression"),
               status=result.get("status", "ok"), stop_reason=meta.get("stop_reason"),
               network_mode=network.get("mode"), bandwidth_mbit=network.get("bandwidth_mbit"),
               latency_ms=network.get("latency_ms"), world_size=meta.get("world_size"),
               seed=meta.get("seed"), params=meta.get("params"), target=meta.get("target"),
               higher_is_better=higher, git_commit=git_commit,
               versions=json.dumps(meta.get("versions", {}), sort_keys=True))
    if steps.get("step"):
        clock = steps["t"][-1]
        row.update(steps=len(steps["step"]), epochs=round(steps["epoch"][-1], 3), clock_s=clock,
                   wall_s=meta.get("wall_seconds"),
                   step_ms_median=1e3 * statistics.median(
                       c + k + m for c, k, m in zip(steps["compute_s"], steps["codec_s"], steps["comm_s"])))
        if clock > 0:
            row.update(compute_share=sum(steps["compute_s"]) / clock, codec_share=sum(steps["codec_s"]) / clock,
                       comm_share=sum(steps["comm_s"]) / clock)
    if evals.get("metric"):
        roll = rolling_mean(evals["metric"], window)
        row.update(final_metric=roll[-1], best_metric=(max if higher else min)(roll),
                   tta_s=time_to_target(evals["t"], evals["metric"], meta.get("target"), higher, window)
                   if meta.get("target") is not None else None)
    if wire:
        row.update(bytes_payload=wire.get("payload"), bytes_side=wire.get("side"),
                   side_collectives=wire.get("side_collectives"),
                   bytes_per_step=(wire.get("payload") or 0) + (wire.get("side") or 0))
    return row


def _is_fp16(row):
    spec = row.get("spec") or ""
    return spec in ("fp16", "ddp:fp16") or spec.startswith("fp16:")


def add_baseline_ratios(rows):
    """Fill ``tta_vs_fp16`` and ``fp16_bytes_ratio`` against the FP16 run of the same workload
    and system, and ``tta_vs_best_ddp`` against the fastest DDP run of the same workload (the
    strongest baseline a user could move to: a ratio against Horovod's FP16 alone is never
    shown as a speed-up without it)."""
    best_ddp = {}
    for r in rows:
        if r.get("system") == "ddp" and r.get("status") == "ok" and r.get("tta_s"):
            key = (r["workload"], r["framework"])
            if key not in best_ddp or r["tta_s"] < best_ddp[key]:
                best_ddp[key] = r["tta_s"]
    for r in rows:
        b = best_ddp.get((r["workload"], r["framework"]))
        if b and r.get("tta_s"):
            r["tta_vs_best_ddp"] = b / r["tta_s"]
    base = {}
    for r in rows:
        if _is_fp16(r) and r.get("status") == "ok":
            base.setdefault((r["workload"], r["framework"], r["system"]), r)
    for r in rows:
        b = base.get((r["workload"], r["framework"], r["system"]))
        if b is None:
            continue
        if b.get("tta_s") and r.get("tta_s"):
            r["tta_vs_fp16"] = b["tta_s"] / r["tta_s"]
        if b.get("bytes_per_step") and r.get("bytes_per_step"):
            r["fp16_bytes_ratio"] = b["bytes_per_step"] / r["bytes_per_step"]
    return rows


def write_csvs(out_dir, rows, results):
    """``runs.csv`` (one row per run), ``steps.csv`` and ``evals.csv`` (every record)."""
    with open(os.path.join(out_dir, "runs.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, RUN_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in RUN_COLUMNS})
    with open(os.path.join(out_dir, "steps.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(STEP_COLUMNS)
        for run_id, res in results.items():
            s = res.get("steps") or {}
            for i in range(len(s.get("step", []))):
                w.writerow([run_id] + [s[c][i] for c in STEP_COLUMNS[1:]])
    with open(os.path.join(out_dir, "evals.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(EVAL_COLUMNS)
        for run_id, res in results.items():
            e = res.get("evals") or {}
            window = int(res.get("meta", {}).get("window", 5))
            roll = rolling_mean(e.get("metric", []), window)
            for i in range(len(e.get("step", []))):
                w.writerow([run_id, e["step"][i], e["epoch"][i], e["t"][i], e["metric"][i], roll[i]])


def write_json(path, sweep_meta, rows, results):
    with open(path, "w") as f:
        json.dump({"sweep": sweep_meta, "runs": rows, "results": results}, f, indent=1)


def _fmt(v, kind):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if kind == "s":
        return f"{v:.1f}"
    if kind == "x":
        return f"{v:.2f}x"
    if kind == "pct":
        return f"{100 * v:.0f}%"
    if kind == "mb":
        return f"{v / 1e6:.3f}"
    if kind == "ms":
        return f"{v:.0f}"
    return str(v)


def _metric_text(row):
    v = row.get("final_metric")
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if row.get("higher_is_better") else f"{v:.2f}"


_TABLE = [  # header, key, format
    ("workload", "workload", None), ("run", "label", None), ("TTA s", "tta_s", "s"),
    ("FP16 TTA/ours", "tta_vs_fp16", "x"), ("best DDP TTA/ours", "tta_vs_best_ddp", "x"),
    ("final", None, "metric"), ("steps", "steps", None),
    ("step ms", "step_ms_median", "ms"), ("MB/step", "bytes_per_step", "mb"),
    ("FP16 B/ours", "fp16_bytes_ratio", "x"), ("compute", "compute_share", "pct"),
    ("codec", "codec_share", "pct"), ("comm", "comm_share", "pct"),
]


def _cells(row):
    out = []
    for _, key, kind in _TABLE:
        if kind == "metric":
            out.append(_metric_text(row))
        elif key == "workload":
            out.append(f"{row.get('workload')}" + ("-tf" if row.get("framework") == "tensorflow" else ""))
        elif key == "label" and row.get("status") != "ok":
            out.append(f"{row.get('label')} [{row.get('status')}]")
        elif key == "tta_s" and row.get("status") == "ok" and row.get("tta_s") is None:
            out.append("not reached")
        else:
            out.append(_fmt(row.get(key), kind))
    return out


def table_header(network, rows):
    """The lines above the table: network, definitions."""
    mode = network.get("mode")
    if mode == "loopback":
        net = f"Network: {network.get('note')}"
    else:
        net = f"Network: {network.get('note')} ({network.get('qdisc')})"
    targets = sorted({(r.get("workload"), r.get("target")) for r in rows if r.get("target") is not None},
                     key=str)
    tt = ", ".join(f"{w} {t}" for w, t in targets)
    return [net, f"Targets (rolling metric): {tt}. TTA = training clock to target; ratios are "
                 "FP16 / ours (> 1 better), against the FP16 run of the same workload and system, "
                 "and best DDP / ours against the fastest DDP row of the same workload. "
                 "codec = compress+decompress share of the clock (the overhead)."]


def format_table(rows, network):
    """The summary as fixed-width text (printed at the end of a sweep)."""
    header = [h for h, _, _ in _TABLE]
    body = [_cells(r) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) if i > 1 else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = table_header(network, rows) + ["", line(header), line(["-" * w for w in widths])]
    out += [line(b) for b in body]
    return "\n".join(out)


def markdown_table(rows, network):
    """The summary as a Markdown table with the same columns (for docs)."""
    header = [h for h, _, _ in _TABLE]
    out = ["\n\n".join(table_header(network, rows)), "",
           "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(out)


def plot_rows(rows, results, workload):
    """The summary rows drawn in ``workload``'s plot: runs whose id starts with ``<workload>-``
    and whose result has evaluations (``results``: run id -> result dict). Empty: no plot."""
    return [r for r in rows if r["run_id"].startswith(workload + "-") and results[r["run_id"]].get("evals")]


def plot_path(out_dir, workload):
    """Where a sweep writes ``workload``'s plot: ``<out_dir>/tta_<workload>.png``."""
    return os.path.join(out_dir, f"tta_{workload}.png")


def plot(path, rows, results, title, network):
    """Metric (rolling mean) against training clock, one line per run; FP16/FP32 levels dashed.

    ``rows``/``results`` are those of one workload and framework (Horovod and DDP runs alike).
    The FP16 and FP32 levels are the final rolling metrics of the Horovod runs ``fp16`` and
    ``none`` (FP32); the target is dotted. Writes a PNG with matplotlib's Agg backend.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    higher = True
    levels = {}
    for r in rows:
        res = results.get(r["run_id"]) or {}
        e = res.get("evals") or {}
        if not e.get("t"):
            continue
        higher = bool(r.get("higher_is_better", True))
        window = int(res.get("meta", {}).get("window", 5))
        roll = rolling_mean(e["metric"], window)
        style = "--" if r.get("system") == "ddp" else "-"
        ax.plot(e["t"], roll, style, label=r["label"], linewidth=1.6)
        if r.get("system") != "ddp" and r.get("spec") in ("fp16", "none"):
            levels["FP16" if r["spec"] == "fp16" else "FP32"] = r.get("final_metric")
    colors = {"FP16": "black", "FP32": "grey"}
    for name, level in levels.items():
        if level is not None:
            ax.axhline(level, linestyle="--", color=colors[name], linewidth=1,
                       label=f"{name} converged ({level:.3g})")
    targets = {r.get("target") for r in rows if r.get("target") is not None}
    for t in targets:
        ax.axhline(t, linestyle=":", color="red", linewidth=1, label=f"target {t:g}")
    metric = next((results[r["run_id"]].get("meta", {}).get("metric") for r in rows
                   if results.get(r["run_id"], {}).get("meta")), "metric")
    ax.set_xlabel("training time (s, rank 0 clock, evaluation excluded)")
    ax.set_ylabel(f"{metric} (rolling mean)")
    if higher:
        ymin = min([t for t in targets] + [0.8]) - 0.05
        ax.set_ylim(ymin, 1.0)
    else:
        ax.set_yscale("log")
        top = max([t for t in targets] + [1.0]) * 4
        ax.set_ylim(top=top)
    sub = network.get("note", "")
    ax.set_title(f"{title}\n{sub}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right" if higher else "upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def update_doc(doc_path, block, name="tta-demo"):
    """Replace the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in a file.

    Raises:
        ValueError: the markers are missing (nothing is written).
    """
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    with open(doc_path) as f:
        text = f.read()
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"{doc_path}: expected the markers {start} and {end}")
    text = text[:i + len(start)] + "\n" + block.strip() + "\n" + text[j:]
    with open(doc_path, "w") as f:
        f.write(text)
