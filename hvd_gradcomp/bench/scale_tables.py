"""The tables of the scale study (:mod:`.scale`): steps to target, the modelled time to
accuracy, and the Markdown blocks of the sweep and of the validation, from saved run results
(dicts of :func:`.scale.simulate`, and the real harness's worker results)."""
import math

from . import report
from .model import Measurement, Network, predict_step_time
from .worker import rolling_mean

__all__ = ["final_metric", "steps_to_target", "modelled_tta", "step_parts", "sweep_block",
           "validation_block", "BASELINE", "TARGET_VS_FP16", "WINDOW", "TOLERANCE"]

BASELINE = "fp16"
TARGET_VS_FP16 = 1.02
WINDOW = 5  # evaluations in the rolling mean (the harness's --window)
TOLERANCE = 0.10  # validation: simulated steps within 10% of the real run's


def final_metric(result):
    """The rolling metric at the end of a run."""
    return rolling_mean(result["evals"]["metric"], result.get("window", WINDOW))[-1]


def steps_to_target(result, target):
    """The step of the first evaluation whose rolling mean reaches ``target`` (lower is
    better), or None."""
    i = report.first_reached(result["evals"]["metric"], target, False, result.get("window", WINDOW))
    return None if i is None else result["evals"]["step"][i]


def modelled_tta(result, target, n, gbps, overlap, parts=None):
    """``(steps, step_s, tta_s)``: steps to ``target`` x the modelled step time at ``gbps``
    (``parts``: ``{"compute_s", "codec_s"}`` to use instead of the run's medians)."""
    parts = parts or result
    m = Measurement(compute_s=parts["compute_s"], codec_s=parts["codec_s"],
                    payload_bytes=result["bytes"]["payload"], side_bytes=result["bytes"]["side"],
                    side_collectives=int(result["bytes"]["side_collectives"]))
    step_s = predict_step_time(m, n, gbps, Network(overlap=overlap)).total
    steps = steps_to_target(result, target)
    return steps, step_s, None if steps is None else steps * step_s


def _fmt(v, kind="g"):
    if v is None:
        return "not reached"
    return {"ms": f"{1e3 * v:.3g}" if v < 1e-3 else f"{1e3 * v:.1f}", "s": f"{v:.1f}", "s3": f"{v:.3g}", "int": f"{int(v)}", "B": f"{int(v):,}"}.get(kind, f"{v:g}")


def step_parts(results, calibration=None):
    """``{(n, spec): {"compute_s", "codec_s"}}``: the parts of the modelled step. With a
    ``calibration`` (``{(n, spec): calibrate(...)}``): one compute time for every row (the
    fastest calibrated; the compute of a rank does not depend on the scheme or on N) and each
    row's calibrated codec time; rows without one keep their run's medians."""
    calibration = calibration or {}
    compute = min((c["compute_s"] for c in calibration.values()), default=None)
    out = {}
    for n, rows in results.items():
        for spec, res in rows.items():
            # the calibration at the largest N not above n (the codec's cost per rank follows the
            # payload's layout, which stops changing once THC's lanes are as wide as N needs)
            at = [m for m, sp in calibration if sp == spec and m <= n]
            cal = calibration.get((max(at), spec)) if at else None
            out[(n, spec)] = {"compute_s": compute if cal else res["compute_s"],
                              "codec_s": cal["codec_s"] if cal else res["codec_s"]}
    return out


def _tta_rows(results, parts, gbps, overlap):
    """The runs' table rows and ``best``: ``{(n, gbps, overlap): (spec, tta_s)}``, from the
    step ``parts`` (``{(n, spec): {"compute_s", "codec_s"}}``; runs without parts left out)."""
    lines, best = [], {}
    for n, rows in results.items():
        target = TARGET_VS_FP16 * final_metric(rows[BASELINE])
        for spec, res in rows.items():
            part = parts.get((n, spec))
            if part is None:
                continue
            cells = []
            for o in (0.0, overlap):
                for g in gbps:
                    _, _, tta = modelled_tta(res, target, n, g, o, part)
                    cells.append(_fmt(tta, "s3"))
                    if tta is not None and (best.get((n, g, o)) is None or tta < best[(n, g, o)][1]):
                        best[(n, g, o)] = (spec, tta)
            steps = steps_to_target(res, target)
            lines.append(f"| {n} | {spec} | {_fmt(steps, 'int')} | {res['stop_reason']} at {res['steps_run']} | "
                         f"{_fmt(res['bytes']['payload'], 'B')} | {_fmt(part['compute_s'], 'ms')} | "
                         f"{_fmt(part['codec_s'], 'ms')} | " + " | ".join(cells) + " |")
    return lines, best


def _winners(results, parts, best, gbps, overlap):
    """The table of the soonest row to FP16's target at each N and speed."""
    lines = ["| N | " + " | ".join(f"{g:g} Gbit/s" for g in gbps) + " | " +
             " | ".join(f"{g:g} Gbit/s ovl" for g in gbps) + " |", "|" + "---|" * (1 + 2 * len(gbps))]
    for n, rows in results.items():
        if (n, BASELINE) not in parts:
            continue
        fp16_target = TARGET_VS_FP16 * final_metric(rows[BASELINE])
        cells = []
        for o in (0.0, overlap):
            for g in gbps:
                spec, tta = best.get((n, g, o), (None, None))
                _, _, base = modelled_tta(rows[BASELINE], fp16_target, n, g, o, parts[(n, BASELINE)])
                cells.append("-" if spec is None else f"{spec} ({base / tta:.2f}x fp16)" if base else spec)
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def _header(gbps, compute="compute ms", codec="codec ms"):
    speeds = " | ".join(f"TTA s {g:g}G" for g in gbps)
    return [f"| N | compressor | steps to target | stop | payload B/step | {compute} | {codec} | {speeds} | "
            f"{' | '.join(f'TTA s {g:g}G ovl' for g in gbps)} |", "|" + "---|" * (7 + 2 * len(gbps))]


def sweep_block(results, gbps, overlap, commit, opts, calibration=None, gpu=None):
    """The Markdown block of the sweep (simulated): one table of runs and one of winners with
    the CPU-measured step parts; with ``gpu`` (``{"parts": {(n, spec): {"compute_s",
    "codec_s"}}, "label": text}``, :func:`.scale_gpu.gpu_parts`) the same two tables again
    with the GPU-scaled parts, after them, apart."""
    parts = step_parts(results, calibration)
    how = ("compute (one rank's forward, backward and optimizer step: the fastest of the calibration "
           "repeats, for every row) and codec (one rank's encode + decode, the fastest of its "
           f"calibration's repeats at the largest N of {opts.calibrate_at} not above the row's), in CPU time") if calibration else "compute and codec of one rank (medians over the run's steps)"
    lines = [f"**Simulated** ({opts.workload}, {opts.layout} layout, N virtual ranks in one process, "
             f"batch {opts.batch_size} a rank, budget {opts.max_epochs:g} epochs at N, seed {opts.seed}; "
             f"commit {commit}). Steps are simulated training with the real codec; seconds are "
             f"modelled: steps x ({how}, measured on this machine's CPU, one thread, + the ring "
             f"all-reduce of the payload at N, bench/model.py).", ""]
    rows, best = _tta_rows(results, parts, gbps, overlap)
    lines += _header(gbps) + rows
    lines += ["", f"Soonest to FP16's target, CPU-measured step (simulated steps x modelled step; 'ovl': "
                  f"the all-reduce hidden behind {overlap:.2g} x the compute):", ""]
    lines += _winners(results, parts, best, gbps, overlap)
    if gpu:
        rows, best = _tta_rows(results, gpu["parts"], gbps, overlap)
        lines += ["", f"**Simulated steps, GPU-scaled step** (the same runs; the step's compute and "
                      f"codec scaled to {gpu['label']}; not measured on a GPU):", ""]
        lines += _header(gbps, "GPU compute ms", "GPU codec ms") + rows
        lines += ["", "Soonest to FP16's target, GPU-scaled step:", ""]
        lines += _winners(results, gpu["parts"], best, gbps, overlap)
    return "\n".join(lines)


def validation_block(rows, commit, opts):
    """The Markdown block of the validation: simulated against real, side by side."""
    lines = [f"**Simulated against real** ({opts.workload}, Horovod on loopback, the same seed {opts.seed}, "
             f"data order, batch {opts.batch_size} a rank and budget {opts.max_epochs:g} epochs; commit "
             f"{commit}). Steps to each side's own target (1.02 x its FP16's final rolling perplexity); "
             f"ok: steps within {TOLERANCE:.0%} (or neither side reaching it) and bytes equal. The "
             f"rolling perplexity at the last evaluation both sides made compares rows that stop "
             f"before their target.", "",
             "| N | compressor | steps simulated | steps real | difference | rolling ppl at step (sim / real) | "
             "bytes/step simulated | bytes/step real | ok |", "|---|---|---|---|---|---|---|---|---|"]
    for n, spec, sim, sim_t, real, real_t in rows:
        s = steps_to_target(sim, sim_t)
        r = None
        rb = None
        if real is not None:
            i = report.first_reached(real["evals"]["metric"], real_t, False, int(real["meta"].get("window", WINDOW)))
            r = None if i is None else real["evals"]["step"][i]
            rb = (real.get("bytes_per_step") or {}).get("payload")
        sb = sim["bytes"]["payload"]
        diff = None if s is None or r is None else (s - r) / r
        agree = (diff is not None and abs(diff) <= TOLERANCE) or (real is not None and s is None and r is None)
        ok = agree and sb == rb
        lines.append(f"| {n} | {spec} | {_fmt(s, 'int')} | {_fmt(r, 'int') if real else 'not run'} | "
                     f"{'-' if diff is None else f'{diff:+.1%}'} | {_last_common(sim, real)} | {sb:,} | "
                     f"{'-' if rb is None else f'{rb:,}'} | {'ok' if ok else 'no'} |")
    return "\n".join(lines)


def _last_common(sim, real):
    """``"S: a / b"``: the rolling metric of both sides at the last evaluation step both made."""
    if real is None:
        return "-"
    se, re_ = sim["evals"], real["evals"]
    common = sorted(set(se["step"]) & set(re_["step"]))
    if not common:
        return "-"
    step = common[-1]
    a = rolling_mean(se["metric"], sim.get("window", WINDOW))[se["step"].index(step)]
    b = rolling_mean(re_["metric"], int(real["meta"].get("window", WINDOW)))[re_["step"].index(step)]
    return f"{step}: {a:.3f} / {b:.3f}"


def stop_reason(metric, rolling, target, step, limit, budget):
    """Why a simulated run stops after the evaluation at ``step`` (its last ``metric`` and the
    ``rolling`` mean), or None to go on: "diverged" (a non-finite metric), "target" (the rolling
    metric at or below ``target``), "budget" (``limit`` reached with no target, or the limit is
    the budget) or "cap" (the limit past the budget reached)."""
    if not math.isfinite(metric):
        return "diverged"
    if target is not None and rolling <= target:
        return "target"
    if step >= limit:
        return "budget" if target is None or limit == budget else "cap"
    return None

