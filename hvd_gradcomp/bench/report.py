"""Outputs of the time-to-accuracy harness: each run's summary row, targets and ratios, the
repeats' aggregate, CSV/JSON; the text and Markdown table are in :mod:`.report_table`, the
plots in :mod:`.report_plot`.

Definitions (all times are the training clock of rank 0: the sum of step times, evaluation
excluded, in seconds):

- rolling metric: the trailing mean of the last ``window`` evaluations;
- time-to-target (TTA): the clock at the first evaluation whose rolling metric reaches the
  target (>= for accuracy, <= for perplexity); empty when never reached;
- steady TTA: TTA minus the first step's clock (the clock from the end of the first step to
  the target), which leaves out the first step's one-off costs (Horovod's first negotiation,
  tracing, allocation);
- start-up: wall-clock seconds from the worker process's start to the end of its first step
  (interpreter, imports, Horovod init, model build, tracing and the first step), rank 0;
- repeats (``tta --repeats N``): every row is run N times; its summary
  (:func:`aggregate`) holds the median of each number over the repeats that ran, with the
  min and max of TTA, steady TTA and start-up (``*_min``/``*_max``); a repeat that never
  reached the target counts as an infinite TTA, so the median is "not reached" once half
  the repeats miss; the ratios are computed from the medians;
- TTA vs FP16: FP16's TTA / this run's TTA, against the FP16 run of the same workload and
  system (Horovod-PyTorch, Horovod-TensorFlow, DDP; FSDP rows against FP16-FSDP, spec
  ``fsdp:fp16``: FSDP's own float16 collectives), so > 1 means sooner than FP16;
- final metric: the rolling metric at the last evaluation;
- bytes/step: bytes each rank hands to all-reduces per step (payload + side collectives);
  FP16 bytes / ours is the compression against FP16; FSDP rows (``system`` fsdp): the bytes
  each rank hands to the all-reduce across replicas (its shards), the shard group's
  reduce-scatter apart (``bytes_reduce_scatter``; ``mesh`` is R x S);
- shares: compute, compress+decompress ("codec") and communication time as fractions of the
  training clock; "overhead share" is the codec share;
- the no-communication reference (``reference`` column True; ``tta --no-comm-reference``):
  the same FP32 training with the network left out (an unthrottled loopback link), the limit
  any compressor can approach. It is a reference, not a competitor: it gets its own ratios
  against FP16 (how much any compressor could gain at most) but is never a baseline (FP16,
  best DDP) nor a row that "best" picks, has its own line in the plots, and its network
  columns are its own link's (``loopback``), not the sweep's.
"""
import csv
import json
import math
import os
import statistics

from . import fp16_estimate
from .fp16_estimate import is_fp16_row as _is_fp16, is_reference
from .worker import rolling_mean

__all__ = ["wait_share", "time_to_target", "first_reached", "apply_targets", "adam_ratios",
           "format_adam_ratios", "ADAM_COLUMNS", "summarize", "add_baseline_ratios", "aggregate",
           "row_key", "repeated", "workload_name", "is_reference", "RUN_COLUMNS", "SUMMARY_COLUMNS",
           "SPREAD_KEYS", "STEP_COLUMNS", "EVAL_COLUMNS", "write_summary_csv", "write_csvs",
           "write_json", "update_doc"]

RUN_COLUMNS = [
    "run_id", "repeat", "workload", "framework", "system", "reference", "label", "spec", "optimizer", "accumulate", "update_sync", "num_groups", "delay", "status", "stop_reason",
    "network_mode", "bandwidth_mbit", "latency_ms", "world_size", "seed", "params", "target", "target_vs_fp16",
    "higher_is_better", "steps", "epochs", "clock_s", "wall_s", "tta_s", "tta_steady_s", "startup_s", "first_step_s", "tta_vs_fp16", "tta_vs_best_ddp",
    "steps_to_target", "steps_vs_fp16", "step_time_vs_fp16",
    "final_metric", "best_metric", "bytes_payload", "bytes_side", "side_collectives",
    "bytes_per_step", "fp16_bytes_ratio", "step_ms_median", "compute_share", "codec_share",
    "comm_share", "wait_share", "fp16_estimate", "choices", "mesh", "bytes_reduce_scatter", "git_commit", "versions",
]
# A table row over the repeats of one (workload, framework, system, spec): the run columns
# (medians; run_id without the repeat suffix, repeat empty) plus how many ran and the spread.
SPREAD_KEYS = ("tta_s", "tta_steady_s", "startup_s")
SUMMARY_COLUMNS = RUN_COLUMNS[:2] + ["repeats", "runs_ok", "tta_reached"] + RUN_COLUMNS[2:] + [
    f"{k}_{e}" for k in SPREAD_KEYS for e in ("min", "max")]
STEP_COLUMNS = ["run_id", "step", "epoch", "t", "compute_s", "codec_s", "comm_s", "wait_s", "loss"]
EVAL_COLUMNS = ["run_id", "step", "epoch", "t", "metric", "rolling"]
ADAM_COLUMNS = ["run_id", "step", "tensor", "numel", "update_rms", "grad_rms", "v_mean", "m_rms"]
# Ratio columns: recomputed from the (median) rows, never medians themselves.
RATIO_KEYS = ("tta_vs_fp16", "tta_vs_best_ddp", "fp16_bytes_ratio", "steps_vs_fp16", "step_time_vs_fp16")


def first_reached(metric, target, higher_is_better=True, window=5):
    """Index of the first evaluation whose trailing rolling mean (``window`` evaluations)
    reaches ``target`` (>= when ``higher_is_better``, else <=); None if none does or
    ``target`` is None.

    Raises:
        ValueError: window < 1.
    """
    if window < 1:
        raise ValueError(f"time_to_target: window must be >= 1, got {window}")
    if target is None:
        return None
    for i, roll in enumerate(rolling_mean(list(metric), window)):
        if (roll >= target) if higher_is_better else (roll <= target):
            return i
    return None


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
    i = first_reached(metric, target, higher_is_better, window)
    return None if i is None else t[i]


def summarize(run_id, result, network, git_commit=None):
    """One summary row (dict with :data:`RUN_COLUMNS`) from a worker's JSON result.

    ``result`` may be a failed run: ``{"meta": {...}, "status": "failed: ..."}`` with no records.
    ``network`` is the sweep's ``describe()``; a result that holds its own (``"network"``:
    the no-communication reference's loopback) is summarised with that one instead.
    ``reference`` is ``meta["reference"]`` (False for records without it).
    """
    meta = result.get("meta", {})
    network = result.get("network") or network
    steps = result.get("steps") or {}
    evals = result.get("evals") or {}
    wire = result.get("bytes_per_step") or {}
    window = int(meta.get("window", 5))
    higher = bool(meta.get("higher_is_better", True))
    row = {c: None for c in RUN_COLUMNS}
    row.update(run_id=run_id, repeat=int(meta.get("repeat", 1)), workload=meta.get("workload"), framework=meta.get("framework"),
               system=meta.get("system"), reference=bool(meta.get("reference", False)),
               label=meta.get("label"), spec=meta.get("compression"), optimizer=meta.get("optimizer") or None,
               accumulate=int(meta.get("accumulate") or 1), update_sync=meta.get("update_sync") or None,
               num_groups=int(meta.get("num_groups") or 0), delay=int(meta.get("delay") or 0),
               status=result.get("status", "ok"), stop_reason=meta.get("stop_reason"),
               network_mode=network.get("mode"), bandwidth_mbit=network.get("bandwidth_mbit"),
               latency_ms=network.get("latency_ms"), world_size=meta.get("world_size"),
               seed=meta.get("seed"), params=meta.get("params"), target=meta.get("target"),
               target_vs_fp16=meta.get("target_vs_fp16") or None,
               higher_is_better=higher, git_commit=git_commit, mesh=meta.get("mesh"),
               fp16_estimate=meta.get("fp16_estimate") or None,
               versions=json.dumps(meta.get("versions", {}), sort_keys=True))
    if steps.get("step"):
        clock = steps["t"][-1]
        row.update(steps=len(steps["step"]), epochs=round(steps["epoch"][-1], 3), clock_s=clock,
                   wall_s=meta.get("wall_seconds"), first_step_s=steps["t"][0],
                   startup_s=meta.get("startup_s"),
                   step_ms_median=1e3 * statistics.median(
                       c + k + m for c, k, m in zip(steps["compute_s"], steps["codec_s"], steps["comm_s"])))
        if clock > 0:
            row.update(compute_share=sum(steps["compute_s"]) / clock, codec_share=sum(steps["codec_s"]) / clock,
                       comm_share=sum(steps["comm_s"]) / clock, wait_share=wait_share(steps))
    if evals.get("metric"):
        roll = rolling_mean(evals["metric"], window)
        row.update(final_metric=roll[-1], best_metric=(max if higher else min)(roll))
        _set_reached(row, evals, window)
    if wire:
        row.update(bytes_payload=wire.get("payload"), bytes_side=wire.get("side"),
                   side_collectives=wire.get("side_collectives"),
                   bytes_per_step=(wire.get("payload") or 0) + (wire.get("side") or 0),
                   bytes_reduce_scatter=wire.get("reduce_scatter"))
        if wire.get("choices"):  # auto: the scheme each tensor ended on
            row["choices"] = "; ".join(f"{k}: {v}" for k, v in sorted(wire["choices"].items()))
    return row


def wait_share(steps):
    """The share of the training clock a run's steps were blocked on the link: the sum of its
    per-step ``wait_s`` (:meth:`.worker.Recorder.step`, a part of ``comm_s``) over the clock
    (the sum of compute, codec and comm); None when some step did not measure it (records
    saved before the wait was recorded, or a worker that does not measure it)."""
    waits = steps.get("wait_s")
    if not waits or any(w is None for w in waits) or len(waits) != len(steps.get("comm_s") or []):
        return None
    clock = sum(steps["compute_s"]) + sum(steps["codec_s"]) + sum(steps["comm_s"])
    return sum(waits) / clock if clock > 0 else None


def _set_reached(row, evals, window):
    """Set ``tta_s``, ``tta_steady_s`` and ``steps_to_target`` of ``row`` from its
    evaluations and ``row["target"]`` (None: not reached)."""
    i = first_reached(evals["metric"], row.get("target"), bool(row.get("higher_is_better", True)), window)
    row["tta_s"] = None if i is None else evals["t"][i]
    row["steps_to_target"] = None if i is None else evals["step"][i]
    row["tta_steady_s"] = None
    if row["tta_s"] is not None and row.get("first_step_s") is not None:
        row["tta_steady_s"] = max(0.0, row["tta_s"] - row["first_step_s"])


def apply_targets(rows, results):
    """Resolve targets relative to FP16 and (re)compute reaching them, in place; returns ``rows``.

    A row whose run recorded ``target_vs_fp16`` = f (``lm-comm``: 1.02) gets the target f x
    FP16's final rolling metric: the median over the FP16 rows (:func:`_is_fp16`, not the
    reference, status ok) of the same workload and framework in ``rows``, Horovod's when
    there are any, else DDP's; an FSDP row's, FP16-FSDP's only (never another system's); with
    no such row its target is None (not reached). Then every
    row with evaluations in ``results`` (run id -> result) gets ``tta_s``, ``tta_steady_s``
    and ``steps_to_target`` for its target (so published sweeps saved before
    ``steps_to_target`` existed get it too).
    """
    finals = {}
    for r in rows:
        # an FP16 run stopped early on a slow link (fp16_estimate): the reference run's final metric
        final = (r.get("fp16_estimate") or {}).get("final_metric", r.get("final_metric"))
        if _is_fp16(r) and not is_reference(r) and r.get("status") == "ok" and final is not None:
            finals.setdefault((r.get("workload"), r.get("framework"), _target_system(r)), []).append(final)
    for r in rows:
        res = results.get(r.get("run_id")) or {}
        factor = r.get("target_vs_fp16") or (res.get("meta") or {}).get("target_vs_fp16")
        if factor:
            r["target_vs_fp16"] = factor
            key = (r.get("workload"), r.get("framework"))
            base = finals.get(key + ("fsdp",)) if r.get("system") == "fsdp" else \
                finals.get(key + ("horovod",)) or finals.get(key + ("ddp",))
            r["target"] = factor * statistics.median(base) if base else None
        evals = res.get("evals") or {}
        if evals.get("metric") and evals.get("step"):
            _set_reached(r, evals, int((res.get("meta") or {}).get("window", 5)))
        est = fp16_estimate.estimated_tta(res) if r.get("fp16_estimate") else None
        if est is not None:  # stopped early: the reference's steps x this run's median step
            r["tta_s"], r["steps_to_target"], r["tta_steady_s"] = est[0], est[1], None
    return rows


def _target_system(row):
    """Whose FP16 sets a row's target (:func:`apply_targets`): ``"fsdp"``, ``"ddp"`` or
    ``"horovod"``."""
    return {"fsdp": "fsdp", "ddp": "ddp"}.get(row.get("system"), "horovod")


def adam_ratios(rows, results, min_numel=1024):
    """Adam's statistics of each run against its FP16 run (issue 25's mechanism check).

    For every run with optimizer-probe records (``results[run_id]["adam"]``, see
    ``workers.torch_workloads.AdamProbe``) and the FP16 row of the same workload, framework
    and system (:func:`_is_fp16`, not the reference) with records, at each step both logged:
    the geometric mean over the tensors both logged with values > 0 and at least
    ``min_numel`` elements (default 1024: those the routing compresses by default; smaller
    ones go as fp16) of ours / FP16's ``v_mean`` (Adam's mean second moment),
    ``update_rms`` and ``grad_rms``.

    Returns:
        a list of dicts ``{"run_id", "label", "step", "v_ratio", "update_ratio",
        "grad_ratio", "tensors"}``, in ``rows`` order then step order (FP16's own rows, all
        1.0, left out).
    """
    base = {}
    for r in rows:
        if _is_fp16(r) and not is_reference(r) and (results.get(r["run_id"]) or {}).get("adam"):
            base.setdefault((r.get("workload"), r.get("framework"), r.get("system")), results[r["run_id"]]["adam"])
    out = []
    for r in rows:
        ours = (results.get(r["run_id"]) or {}).get("adam")
        fp16 = base.get((r.get("workload"), r.get("framework"), r.get("system")))
        if not ours or not fp16 or ours is fp16 or _is_fp16(r):
            continue
        where = {step: i for i, step in enumerate(fp16["steps"])}
        for i, step in enumerate(ours["steps"]):
            j = where.get(step)
            if j is None:
                continue
            line = {"run_id": r["run_id"], "label": r.get("label"), "step": step}
            for key, col in (("v_mean", "v_ratio"), ("update_rms", "update_ratio"), ("grad_rms", "grad_ratio")):
                logs = []
                for name, t in ours["tensors"].items():
                    b = fp16["tensors"].get(name)
                    if t["numel"] < min_numel:
                        continue
                    a, c = t[key][i], (b[key][j] if b else None)
                    if a and c and a > 0 and c > 0:
                        logs.append(math.log(a / c))
                line[col] = math.exp(sum(logs) / len(logs)) if logs else None
                line["tensors"] = len(logs)
            out.append(line)
    return out


def format_adam_ratios(lines):
    """:func:`adam_ratios` as a Markdown table (empty string for no lines)."""
    if not lines:
        return ""
    f = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    out = ["| run | step | v ours/FP16 | update RMS ours/FP16 | gradient RMS ours/FP16 |",
           "|---|---|---|---|---|"]
    out += [f"| {x['label']} | {x['step']} | {f(x['v_ratio'])} | {f(x['update_ratio'])} | {f(x['grad_ratio'])} |"
            for x in lines]
    return "\n".join(out)


def add_baseline_ratios(rows):
    """Fill ``tta_vs_fp16`` and ``fp16_bytes_ratio`` against the FP16 run of the same workload
    and system, and ``tta_vs_best_ddp`` against the fastest DDP run of the same workload (the
    strongest baseline a user could move to: a ratio against Horovod's FP16 alone is never
    shown as a speed-up without it). The no-communication reference (:func:`is_reference`)
    gets these ratios too but is never the FP16 baseline nor the best DDP row."""
    best_ddp = {}
    for r in rows:
        if r.get("system") == "ddp" and not is_reference(r) and r.get("status") == "ok" and r.get("tta_s"):
            key = (r["workload"], r["framework"])
            if key not in best_ddp or r["tta_s"] < best_ddp[key]:
                best_ddp[key] = r["tta_s"]
    for r in rows:
        b = best_ddp.get((r["workload"], r["framework"]))
        if b and r.get("tta_s"):
            r["tta_vs_best_ddp"] = b / r["tta_s"]
    base = {}
    for r in rows:
        if _is_fp16(r) and not is_reference(r) and r.get("status") == "ok":
            base.setdefault((r["workload"], r["framework"], r["system"]), r)
    for r in rows:
        b = base.get((r["workload"], r["framework"], r["system"]))
        if b is None:
            continue
        if b.get("tta_s") and r.get("tta_s"):
            r["tta_vs_fp16"] = b["tta_s"] / r["tta_s"]
        if b.get("bytes_per_step") and r.get("bytes_per_step"):
            r["fp16_bytes_ratio"] = b["bytes_per_step"] / r["bytes_per_step"]
        if b.get("steps_to_target") and r.get("steps_to_target"):
            r["steps_vs_fp16"] = r["steps_to_target"] / b["steps_to_target"]
        if b.get("step_ms_median") and r.get("step_ms_median"):
            r["step_time_vs_fp16"] = b["step_ms_median"] / r["step_ms_median"]
    return rows


def _median_or_none(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def row_key(r):
    """What makes runs repeats of one table row: (workload, framework, system, spec,
    optimizer, accumulate, update_sync, num_groups, reference), so the FP32 row and the no-communication reference (also spec
    ``none``) stay apart, and so do rows of one spec under different optimizers."""
    return (r.get("workload"), r.get("framework"), r.get("system"), r.get("spec"), r.get("optimizer"),
            r.get("accumulate") or 1, r.get("update_sync"), r.get("num_groups") or 0, is_reference(r),
            r.get("delay") or 0)


def aggregate(rows):
    """One summary row per row key (:func:`row_key`: workload, framework, system, spec,
    optimizer, accumulate, update_sync, num_groups, reference) over its repeats, in the order
    the rows first appear (so round 1's order, the table order).

    Each summary holds the run columns as medians over the repeats whose status is "ok"
    (text columns from the first repeat; ``run_id`` without its ``-r<k>`` suffix, ``repeat``
    None), ``repeats`` (runs), ``runs_ok`` and ``tta_reached`` (repeats that reached the
    target), and ``<key>_min``/``<key>_max`` for TTA, steady TTA and start-up (seconds). A
    repeat that never reached the target counts as an infinite TTA: the median is None ("not
    reached") once half of them miss, and the max is None when any missed. ``status`` is
    "ok" when every repeat is, else "<n> of <N> failed" (medians over the rest). The ratio
    columns are recomputed from the medians (:func:`add_baseline_ratios`).
    """
    groups = {}
    for r in rows:
        groups.setdefault(row_key(r), []).append(r)
    out = []
    for members in groups.values():
        ok = [r for r in members if r.get("status") == "ok"]
        first = (ok or members)[0]
        s = {c: first.get(c) for c in SUMMARY_COLUMNS}
        s.update(run_id=_base_id(first.get("run_id")), repeat=None, repeats=len(members), runs_ok=len(ok),
                 tta_reached=sum(1 for r in ok if r.get("tta_s") is not None))
        bad = len(members) - len(ok)
        s["status"] = "ok" if not bad else f"{bad} of {len(members)} failed"
        for c in RUN_COLUMNS:
            # (accumulate, num_groups: part of the row key, equal over the repeats; kept as ints)
            if c in ("run_id", "repeat", "steps_to_target", "accumulate", "num_groups", "delay") or c in RATIO_KEYS \
                    or c in SPREAD_KEYS:
                continue
            vals = [r.get(c) for r in ok]
            if vals and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals if v is not None) \
                    and any(v is not None for v in vals):
                s[c] = _median_or_none(vals)
        reached = [math.inf if r.get("steps_to_target") is None else r["steps_to_target"] for r in ok]
        med = statistics.median(reached) if reached else math.inf
        s["steps_to_target"] = None if math.isinf(med) else med
        for k in SPREAD_KEYS:
            present = [r.get(k) for r in ok]
            if k in ("tta_s", "tta_steady_s"):  # not reached: +inf
                inf = [math.inf if v is None else v for v in present]
                med = statistics.median(inf) if inf else math.inf
                s[k] = None if math.isinf(med) else med
                s[k + "_min"] = None if not inf or math.isinf(min(inf)) else min(inf)
                s[k + "_max"] = None if not inf or math.isinf(max(inf)) else max(inf)
            else:
                vals = [v for v in present if v is not None]
                s[k] = statistics.median(vals) if vals else None
                s[k + "_min"] = min(vals) if vals else None
                s[k + "_max"] = max(vals) if vals else None
        out.append(s)
    return add_baseline_ratios(out)


def _base_id(run_id):
    """``digits-horovod-fp16-r2`` -> ``digits-horovod-fp16`` (run ids of repeats end in ``-r<k>``)."""
    if run_id is None:
        return None
    head, sep, tail = run_id.rpartition("-r")
    return head if sep and tail.isdigit() else run_id


def repeated(rows):
    """True when some row is a repeat beyond the first (``repeat`` > 1): the table then shows
    one line per :func:`aggregate` summary instead of one per run."""
    return any((r.get("repeat") or 1) > 1 for r in rows)


def write_summary_csv(path, summary):
    """``summary.csv``: one row per table row (:data:`SUMMARY_COLUMNS`, :func:`aggregate`)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, SUMMARY_COLUMNS)
        w.writeheader()
        for r in summary:
            w.writerow({k: r.get(k) for k in SUMMARY_COLUMNS})


def write_csvs(out_dir, rows, results):
    """``runs.csv`` (one row per run), ``steps.csv`` and ``evals.csv`` (every record), and
    ``adam.csv`` (:data:`ADAM_COLUMNS`: the optimizer probe's per-tensor statistics, one line
    per run, logged step and tensor) when some run logged them."""
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
                w.writerow([run_id] + [s[c][i] if c in s else None for c in STEP_COLUMNS[1:]])
    with open(os.path.join(out_dir, "evals.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(EVAL_COLUMNS)
        for run_id, res in results.items():
            e = res.get("evals") or {}
            window = int(res.get("meta", {}).get("window", 5))
            roll = rolling_mean(e.get("metric", []), window)
            for i in range(len(e.get("step", []))):
                w.writerow([run_id, e["step"][i], e["epoch"][i], e["t"][i], e["metric"][i], roll[i]])
    if any(res.get("adam") for res in results.values()):
        with open(os.path.join(out_dir, "adam.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(ADAM_COLUMNS)
            for run_id, res in results.items():
                a = res.get("adam") or {}
                for i, step in enumerate(a.get("steps", [])):
                    for name, t in a.get("tensors", {}).items():
                        w.writerow([run_id, step, name, t["numel"]] + [t[k][i] for k in ADAM_COLUMNS[4:]])


def write_json(path, sweep_meta, rows, results, summary=None):
    """``results.json``: ``sweep`` (metadata), ``runs`` (one row per run, :data:`RUN_COLUMNS`),
    ``results`` (run id -> the worker's records) and, when given, ``summary`` (one row per
    table row over the repeats, :data:`SUMMARY_COLUMNS`)."""
    data = {"sweep": sweep_meta, "runs": rows, "results": results}
    if summary is not None:
        data["summary"] = summary
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def workload_name(row):
    """The sweep's name of a row's workload: the worker's ``workload`` field, with ``-tf`` for
    TensorFlow runs (the TF digits worker records ``"digits"``, or ``"digits-eager"`` with its
    step run eagerly; the sweep calls them ``digits-tf`` and ``digits-tf-eager``). None for
    records without the field."""
    w = row.get("workload")
    if w and row.get("framework") == "tensorflow" and "-tf" not in w:
        base, eager = (w[:-len("-eager")], True) if w.endswith("-eager") else (w, False)
        w = base + "-tf" + ("-eager" if eager else "")
    return w


def update_doc(doc_path, block, name="tta-demo"):
    """Replace the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in a file
    (the core's :func:`hvd_gradcomp.__main__.update_block`, which writes the option table).

    Raises:
        ValueError: the markers are missing (nothing is written).
    """
    from hvd_gradcomp.__main__ import update_block
    update_block(doc_path, block, name)
