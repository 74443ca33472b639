"""The time-to-accuracy sweep's table: fixed-width text (printed at a sweep's end) and Markdown
(for docs), one line per run or per row over its repeats, with the lines above it (network,
targets, definitions, what stopped the rows) and the ``auto`` rows' choices under it. The
numbers are :mod:`.report`'s summary rows (its docstring defines them).
"""
import math

from . import fp16_estimate
from .fp16_estimate import is_fp16_row as _is_fp16, is_reference
from .report import SPREAD_KEYS, aggregate, repeated, workload_name

__all__ = ["format_table", "markdown_table", "table_header", "stop_note", "choice_notes"]


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


def _reach_text(row):
    """``steps to target``: the steps, with ours/FP16's marked ``x`` when FP16 reached it
    (``152 (1.13x)``); "not reached" for a run that evaluated and never reached it; "-" for a
    run without evaluations."""
    n, ratio = row.get("steps_to_target"), row.get("steps_vs_fp16")
    if n is None:
        return "not reached" if row.get("status") == "ok" and row.get("final_metric") is not None else "-"
    return f"{n:.0f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def _metric_text(row):
    v = row.get("final_metric")
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if row.get("higher_is_better") else f"{v:.2f}"


_TABLE = [  # header, key, format
    ("workload", "workload", None), ("run", "label", None), ("TTA s", "tta_s", "s"),
    ("FP16 TTA/ours", "tta_vs_fp16", "x"), ("best DDP TTA/ours", "tta_vs_best_ddp", "x"),
    ("steps to target", "steps_to_target", "reach"), ("FP16 step/ours", "step_time_vs_fp16", "x"),
    ("final", None, "metric"), ("steps", "steps", None),
    ("step ms", "step_ms_median", "ms"), ("MB/step", "bytes_per_step", "mb"),
    ("FP16 B/ours", "fp16_bytes_ratio", "x"), ("compute", "compute_share", "pct"),
    ("codec", "codec_share", "pct"), ("comm", "comm_share", "pct"),
]


# Shown after "TTA s" when some row has a start-up time (sweeps before it have none, and
# their published blocks stay as they were).
_STARTUP_COLUMNS = [("steady TTA s", "tta_steady_s", "s"), ("start s", "startup_s", "s")]


# Shown after "comm" when some row measured its wait (sweeps before it did not).
_WAIT_COLUMN = ("wait", "wait_share", "pct")


def _columns(rows):
    """The table's (header, key, format) list for these rows (see :data:`_STARTUP_COLUMNS`,
    :data:`_WAIT_COLUMN`)."""
    cols = list(_TABLE)
    if any(r.get("wait_share") is not None for r in rows):
        cols.append(_WAIT_COLUMN)
    if any(r.get("startup_s") is not None for r in rows):
        cols[3:3] = _STARTUP_COLUMNS
    if repeated(rows):
        cols = [("TTA s median (min-max)" if k == "tta_s" else h, k, f) for h, k, f in cols]
    return cols


def _spread(row, key, kind):
    """``median (min-max)`` of a summary over repeats (:func:`aggregate`); for TTA columns
    "nr" as the max when some repeat did not reach the target, "not reached" as the median
    when half of them did not."""
    med, lo, hi = row.get(key), row.get(key + "_min"), row.get(key + "_max")
    if key == "startup_s":
        return "-" if med is None else f"{_fmt(med, kind)} ({_fmt(lo, kind)}-{_fmt(hi, kind)})"
    text = "not reached" if med is None else _fmt(med, kind)
    if lo is None:  # no repeat reached the target
        return text
    return f"{text} ({_fmt(lo, kind)}-{'nr' if hi is None else _fmt(hi, kind)})"


def _cells(row, columns=_TABLE):
    out = []
    for _, key, kind in columns:
        if kind == "metric":
            out.append(_metric_text(row))
        elif kind == "reach":
            out.append(_reach_text(row))
        elif key == "workload":
            out.append(f"{workload_name(row)}")
        elif key == "label" and row.get("status") != "ok":
            out.append(f"{row.get('label')} [{row.get('status')}]")
        elif key in SPREAD_KEYS and (row.get("repeats") or 1) > 1 and row.get("runs_ok"):
            out.append(_spread(row, key, kind))
        elif key == "tta_s" and row.get("status") == "ok" and row.get("tta_s") is None:
            out.append("not reached")
        else:
            out.append(_fmt(row.get(key), kind))
        if row.get("fp16_estimate"):  # FP16 stopped early on a slow link: its cells say so
            out[-1] = fp16_estimate.cell_text(row, key, out[-1])
    return out


def stop_note(rows, results):
    """A sentence per workload whose rows after FP16 were stopped by the harness at FP16's
    target or a cap (``tta_run.stop_flags``), read from the runs' saved records: the time cap
    (``meta["stop_cap"]``: cap x FP16's TTA) or, for sweeps saved before it, the step cap
    (``--max-steps N`` in the worker's ``argv``); "" when there is none."""
    out = []
    groups = dict.fromkeys((workload_name(r), r.get("system") == "fsdp") for r in rows)
    for w, fsdp in groups:
        fp16 = next((r for r in rows if workload_name(r) == w and _is_fp16(r) and not is_reference(r)
                     and r.get("system") != "ddp" and (r.get("system") == "fsdp") == fsdp), None)
        for r in rows:
            if workload_name(r) != w or r is fp16 or r.get("status") != "ok" or (r.get("system") == "fsdp") != fsdp:
                continue
            meta = (results.get(r.get("run_id")) or {}).get("meta") or {}
            cap = meta.get("stop_cap")
            if cap:
                who, base = ("FSDP row", "FP16-FSDP") if fsdp else ("row", "FP16")
                est = " estimated" if cap.get("estimated") else ""
                out.append(f"{w}: every {who} after {base} stopped at the target or when its training "
                           f"clock passed {cap['cap']:g} x {base}'s{est} TTA ({cap['fp16_tta_s']:.1f} s), "
                           f"i.e. {cap['max_seconds']:.1f} s (checked at each evaluation).")
                break
            argv = [str(a) for a in meta.get("argv") or []]
            if "--max-steps" in argv and meta.get("target") is not None and meta.get("target_vs_fp16"):
                n = argv[len(argv) - 1 - argv[::-1].index("--max-steps") + 1]
                base = f" ({int(n) / fp16['steps']:.2f} x FP16's {fp16['steps']} steps)" if fp16 and fp16.get("steps") else ""
                out.append(f"{w}: every row after FP16 stopped at the target or after {n} steps{base}.")
                break
    return " ".join(out)


def table_header(network, rows, results=None):
    """The lines above the table: network, definitions (and, given the runs' ``results``,
    what stopped the rows after FP16: :func:`stop_note`)."""
    mode = network.get("mode")
    if mode == "loopback":
        net = f"Network: {network.get('note')}"
    else:
        net = f"Network: {network.get('note')} ({network.get('qdisc')})"
    if network.get("malloc") == "keep":
        net += (". glibc malloc, every row: freed memory kept (no mmap, no trim), so large "
                "tensors are not page-faulted in again each step")
    elif network.get("malloc"):
        net += f". glibc malloc: {network['malloc']}"
    targets = sorted({(r.get("workload"), r.get("target"), r.get("target_vs_fp16"), r.get("system") == "fsdp")
                      for r in rows if r.get("target") is not None}, key=str)
    estimated = {r.get("workload") for r in rows if r.get("fp16_estimate")}  # FP16 stopped early
    tt = ", ".join((f"{w} {t:.4g} ({f:g} x {'FP16-FSDP' if fsdp else 'FP16'}'s final rolling metric "
                    + ("in the reference sweep named below" if w in estimated and not fsdp else "in this sweep") + ")"
                    + (" for the FSDP rows" if fsdp else "")) if f else f"{w} {t}"
                   for w, t, f, fsdp in targets)
    lines = [net, f"Targets (rolling metric): {tt}. TTA = training clock to target; ratios are "
                  "FP16 / ours (> 1 better), against the FP16 run of the same workload and system, "
                  "and best DDP / ours against the fastest DDP row of the same workload. "
                  "steps to target = optimizer steps to the evaluation that reached the target, "
                  "with ours / FP16's (> 1: more steps than FP16, the convergence cost); "
                  "FP16 step/ours = FP16's median step time over ours (> 1: faster steps, the "
                  "speed), so FP16 TTA/ours is about FP16 step/ours divided by the steps ratio. "
                  "codec = compress+decompress share of the clock (the overhead)."]
    note = stop_note(rows, results) if results else ""
    if note:
        lines[1] += " " + note
    note = fp16_estimate.header_note(rows)
    if note:
        lines[1] += " " + note
    if any((r.get("accumulate") or 1) > 1 for r in rows):
        lines[1] += (" accumulate(K) rows: K micro-batches (of the usual size) per optimizer step "
                     "and all-reduce; their steps are micro-batches, so steps compare with FP16's "
                     "at equal data, and step ms is a micro-batch's median.")
    if any(r.get("num_groups") for r in rows):
        lines[1] += (" groups(G) rows: Horovod's num_groups=G, the gradients all-reduced in G "
                     "groups, each compressed as one bucket per route (one codec call per group "
                     "and route instead of one per tensor).")
    if any(r.get("wait_share") is not None for r in rows):
        lines[1] += (" wait = the share of the clock a step was blocked on the link, a part of "
                     "comm (comm less the posting of collectives): gradient rows wait for their "
                     "all-reduces after backward (all of comm); update-sync rows in the sync's "
                     "waits and count check (with overlap: for the round in flight); '-': not "
                     "measured.")
    if any(r.get("delay") for r in rows):
        lines[1] += (" delay(D) rows: our compressor as a DDP hook with delayed gradient sync "
                     "(torch_backend.ddp.register_comm_hook(..., delay=D)): step t's mean is "
                     "applied at step t + D, its all-reduce running beside the next steps.")
    if any(r.get("update_sync") for r in rows):
        lines[1] += (" update-sync rows: each rank steps its own optimizer on its own gradient and "
                     "the ranks all-reduce the compressed parameter change every H steps "
                     "(torch_backend.UpdateSync; H > 1: local steps with an outer Nesterov step).")
    if any(r.get("startup_s") is not None for r in rows):
        lines[1] += (" steady TTA = clock from the end of the first step to target; start = wall "
                     "seconds from the worker's process start to the end of its first step "
                     "(imports, Horovod init, tracing, first step), rank 0.")
    if any(r.get("system") == "fsdp" for r in rows):
        meshes = sorted({r.get("mesh") for r in rows if r.get("system") == "fsdp" and r.get("mesh")})
        lines[1] += (f" FSDP rows: HSDP (FSDP2 fully_shard on a replicas x shards mesh, "
                     f"{', '.join(meshes) or '?'}), reduced in float16; FP16-FSDP (FSDP's own "
                     "float16 reduce-scatter and all-reduce) is their baseline: their target, ratios "
                     "and time cap are FP16-FSDP's; '<spec> on FSDP' compresses the all-reduce across "
                     "replicas (torch_backend.fsdp.install), ', rs <spec>' the reduce-scatter too; "
                     "their B/step is each rank's bytes to the all-reduce across replicas (its "
                     "shards), the reduce-scatter within a replica apart (runs.csv "
                     "bytes_reduce_scatter).")
    if any(is_reference(r) for r in rows):
        lines[1] += (" The no-communication row is a reference, not a competitor: the same FP32 "
                     "training on an unthrottled loopback link (the network left out), the limit "
                     "any compressor can approach; its comm share is the loopback all-reduce's "
                     "own CPU cost, and it is never a baseline.")
    if repeated(rows):
        n = max(r.get("repeat") or 1 for r in rows)
        lines[1] += (f" Each row: {n} repeats, run interleaved (round 1 of every row, then round "
                     "2, ...); numbers are medians over the repeats, the TTA and start columns "
                     "with their min-max in parentheses (nr: a repeat did not reach the "
                     "target); ratios from the medians.")
    return lines


def format_table(rows, network, results=None):
    """The summary as fixed-width text (printed at the end of a sweep): one line per run, or
    per row over its repeats (:func:`aggregate`) when the sweep repeated its runs; ``results``
    (run id -> record) adds :func:`stop_note` to the header."""
    columns = _columns(rows)
    header = [h for h, _, _ in columns]
    body = [_cells(r, columns) for r in (aggregate(rows) if repeated(rows) else rows)]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) if i > 1 else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = table_header(network, rows, results) + ["", line(header), line(["-" * w for w in widths])]
    out += [line(b) for b in body]
    notes = choice_notes(aggregate(rows) if repeated(rows) else rows)
    return "\n".join(out + ([""] + notes if notes else []))


def markdown_table(rows, network, results=None):
    """The summary as a Markdown table with the same columns and rows (for docs); ``results``
    as in :func:`format_table`."""
    columns = _columns(rows)
    header = [h for h, _, _ in columns]
    out = ["\n\n".join(table_header(network, rows, results)), "",
           "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_cells(r, columns)) + " |" for r in (aggregate(rows) if repeated(rows) else rows)]
    notes = choice_notes(aggregate(rows) if repeated(rows) else rows)
    return "\n".join(out + ([""] + notes if notes else []))


def choice_notes(rows):
    """Lines under a table: what each ``auto`` row's tensors ended on (its ``choices``)."""
    return [f"{r.get('label') or r.get('spec')} ({r.get('workload')}) ended on: {r['choices']}"
            for r in rows if r.get("choices")]
