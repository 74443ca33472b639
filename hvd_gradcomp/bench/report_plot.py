"""The time-to-accuracy sweep's plots: metric against training clock per workload (repeats as a
median with a min-max band, FP16/FP32 levels and the target), and ``auto``'s choice per tensor
over the steps. Written with matplotlib's Agg backend, imported on the first plot.
"""
import os
import statistics

from .fp16_estimate import is_reference
from .report import row_key, workload_name
from .worker import rolling_mean

__all__ = ["plot", "plot_rows", "plot_path", "converged_levels", "plot_choices", "choice_rows",
           "choices_plot_path", "choice_segments"]


def plot_rows(rows, results, workload):
    """The summary rows drawn in ``workload``'s plot: runs of that workload (by
    :func:`workload_name`; by the run id prefix ``<workload>-`` for records without the field,
    so ``digits`` never takes ``digits-tf`` runs that have it) whose result has evaluations
    (``results``: run id -> result dict). Empty: no plot."""
    def ours(r):
        name = workload_name(r)
        return name == workload if name else r["run_id"].startswith(workload + "-")
    return [r for r in rows if ours(r) and results[r["run_id"]].get("evals")]


def plot_path(out_dir, workload):
    """Where a sweep writes ``workload``'s plot: ``<out_dir>/tta_<workload>.png``."""
    return os.path.join(out_dir, f"tta_{workload}.png")


def converged_levels(rows):
    """``{"FP16": level, "FP32": level, "FP16-FSDP": level}``: the median final rolling metric
    of the Horovod rows ``fp16`` and ``none`` (FP32) and of FP16-FSDP (``fsdp:fp16``) among
    ``rows``, for those present (None where no repeat has a final metric). DDP rows, other
    FSDP rows, the no-communication reference (also spec ``none``) and rows with another
    optimizer, gradient accumulation, groups or update sync are not levels."""
    finals = {}
    for r in rows:
        plain = not r.get("optimizer") and (r.get("accumulate") or 1) == 1 and not r.get("update_sync") \
            and not r.get("num_groups")
        if r.get("system") == "fsdp" and plain and r.get("spec") == "fsdp:fp16":
            name = "FP16-FSDP"
        elif r.get("system") not in ("ddp", "fsdp") and not is_reference(r) and plain and r.get("spec") in ("fp16", "none"):
            name = "FP16" if r["spec"] == "fp16" else "FP32"
        else:
            continue
        finals.setdefault(name, [])
        if r.get("final_metric") is not None:
            finals[name].append(r["final_metric"])
    return {k: statistics.median(v) if v else None for k, v in finals.items()}


def plot(path, rows, results, title, network):
    """Metric (rolling mean) against training clock, one line per row; FP16/FP32 levels dashed.

    ``rows``/``results`` are those of one workload and framework (Horovod and DDP runs alike).
    A row run once is drawn as its curve. A row with repeats (several runs of one spec, see
    :func:`.report.aggregate`) is drawn as the median of its repeats' curves, each linearly
    interpolated onto a common grid of 200 clock points from 0 to the longest repeat's last
    evaluation (a repeat counts only up to its own last evaluation), with the band between
    their min and max shaded. The FP16 and FP32 levels are the final rolling metrics (median
    over repeats) of the Horovod runs ``fp16`` and ``none`` (FP32); the target is dotted.
    The no-communication reference (:func:`is_reference`) is drawn as a grey dash-dot line
    of its own and is not the FP32 level.
    Writes a PNG with matplotlib's Agg backend.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    import numpy as np
    higher = True
    groups = {}
    for r in rows:
        groups.setdefault(row_key(r), []).append(r)
    for members in groups.values():
        curves = []
        for r in members:
            res = results.get(r["run_id"]) or {}
            e = res.get("evals") or {}
            if e.get("t"):
                window = int(res.get("meta", {}).get("window", 5))
                curves.append((e["t"], rolling_mean(e["metric"], window)))
        if not curves:
            continue
        r = members[0]
        higher = bool(r.get("higher_is_better", True))
        style = {"ddp": "--", "fsdp": ":"}.get(r.get("system"), "-")
        extra = {}
        if is_reference(r):
            style, extra = "-.", {"color": "dimgrey"}
        if len(curves) == 1:
            ax.plot(curves[0][0], curves[0][1], style, label=r["label"], linewidth=1.6, **extra)
        else:
            grid = np.linspace(0.0, max(t[-1] for t, _ in curves), 200)
            ys = np.array([np.where(grid <= t[-1], np.interp(grid, t, y), np.nan) for t, y in curves])
            line, = ax.plot(grid, np.nanmedian(ys, axis=0), style, linewidth=1.6,
                            label=f"{r['label']} (median of {len(curves)})", **extra)
            ax.fill_between(grid, np.nanmin(ys, axis=0), np.nanmax(ys, axis=0), color=line.get_color(),
                            alpha=0.2, linewidth=0)
    levels = converged_levels(rows)
    colors = {"FP16": "black", "FP32": "grey", "FP16-FSDP": "darkblue"}
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


def choice_rows(rows, results, workload):
    """The rows of ``workload`` (as :func:`plot_rows`) whose record holds ``auto`` decisions
    (``bytes_per_step["decisions"]``). Empty: no choices plot."""
    return [r for r in plot_rows(rows, results, workload)
            if ((results[r["run_id"]].get("bytes_per_step") or {}).get("decisions"))]


def choices_plot_path(out_dir, workload):
    """Where a sweep writes ``workload``'s plot of ``auto``'s choices over the steps:
    ``<out_dir>/auto_<workload>.png``."""
    return os.path.join(out_dir, f"auto_{workload}.png")


def choice_segments(result):
    """``{tensor key: [(first step, last step, scheme spec), ...]}`` of one ``auto`` run: each
    tensor starts on fp16 at step 1 (the training steps, counted from 1) and takes a decision's
    scheme from the step after its probe. ``result`` is a run's record
    (``bytes_per_step["decisions"]``, ``steps``)."""
    decisions = (result.get("bytes_per_step") or {}).get("decisions") or []
    last = (result.get("steps") or {}).get("step") or [0]
    end = max([last[-1]] + [d["step"] + 1 for d in decisions])  # the last step trained
    per_key = {}
    for d in sorted(decisions, key=lambda d: d["step"]):
        per_key.setdefault(d["key"], []).append((d["step"] + 2, d["scheme"]))  # probe = step + 1
    out = {}
    for key, changes in sorted(per_key.items()):
        segments, start, scheme = [], 1, "fp16"
        for at, new in changes:
            if new != scheme:
                if at > start:
                    segments.append((start, at - 1, scheme))
                start, scheme = at, new
        if start <= end:  # a decision at the run's last step never took effect
            segments.append((start, end, scheme))
        out[key] = segments
    return out


def plot_choices(path, rows, results, title):
    """``auto``'s choice per tensor over the training steps, one panel per ``auto`` row of one
    workload (:func:`choice_rows`): a horizontal band per tensor, coloured by the scheme it
    used at each step (:func:`choice_segments`). Writes a PNG with matplotlib's Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    panels = [(r, choice_segments(results[r["run_id"]])) for r in rows]
    schemes = sorted({seg[2] for _, segs in panels for per in segs.values() for seg in per})
    colors = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(schemes)}
    height = sum(max(1, len(segs)) for _, segs in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 1.2 + 0.35 * height), dpi=110, squeeze=False)
    for ax, (row, segs) in zip(axes[:, 0], panels):
        keys = list(segs)
        for y, key in enumerate(keys):
            for first, last, scheme in segs[key]:
                ax.barh(y, last - first + 1, left=first - 0.5, height=0.7, color=colors[scheme])
        ax.set_yticks(range(len(keys)))
        ax.set_yticklabels(keys, fontsize=7)
        ax.invert_yaxis()
        repeat = f" (repeat {row['repeat']})" if len(panels) > 1 and row.get("repeat") else ""
        ax.set_title(f"{row.get('label') or row.get('spec')}{repeat}", fontsize=9)
        ax.set_xlabel("training step")
    handles = [Patch(color=colors[s], label=s) for s in schemes]
    fig.legend(handles=handles, fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    fig.savefig(path)
    plt.close(fig)
    return path
