"""FP16's time to target on a slow link, estimated from a sweep on a faster one (issue 49).

On a slow link (5 Mbit/s) FP16's own run to its converged perplexity takes hours, while the
rows that communicate little are what such a sweep is for. So the sweep may stop FP16 early
(``tta --fp16-reference RESULTS --fp16-steps N``): FP16 trains N steps on the slow link,
with the learning-rate schedule of the reference's FP16 run, only to measure its step time,
and its TTA is **its steps to target in the reference sweep (the faster link) times its median
step time measured on the slow link**: FP16's steps do not depend on the link (the same
arithmetic, seeds and data), only its step time does. The table labels that TTA as an
estimate and says where its steps came from. The target of every other row and the
learning-rate schedule they follow are the reference FP16's (1.02 x its final rolling
perplexity, over its step budget), not those of the short run.

What is kept with the FP16 run's records (``meta["fp16_estimate"]``, :func:`reference_meta`)
is all the report needs, so a published block is rebuilt from the saved results alone.
"""
import json
import math

__all__ = ["is_fp16_row", "is_reference", "load_reference", "reference_meta", "fp16_flags", "stop_values", "estimated_tta",
           "cell_text", "header_note"]


def is_fp16_row(row):
    """FP16 with the workload's own optimizer, one micro-batch a step and the gradient
    all-reduce per tensor (a row naming another optimizer, ``accumulate``, ``num_groups`` or
    ``update_sync`` is not the baseline). FSDP: ``fsdp:fp16``, FP16-FSDP (FSDP's own float16 collectives)."""
    spec = row.get("spec") or ""
    return ((spec in ("fp16", "ddp:fp16", "fsdp:fp16") or spec.startswith("fp16:")) and not row.get("optimizer")
            and (row.get("accumulate") or 1) == 1 and not row.get("update_sync") and not row.get("num_groups")
            and not row.get("delay"))


def is_reference(row):
    """True for the no-communication reference row (never a baseline nor a "best" row)."""
    return bool(row.get("reference"))


def load_reference(path, workloads, world_size=None):
    """``{workload: reference}`` from a finished sweep's ``results.json`` at ``path``: per
    workload of ``workloads``, its Horovod FP16 row (plain ``fp16``, status ok, not the
    reference, one that reached its target): ``final_metric`` (its final rolling metric),
    ``target`` and ``target_vs_fp16``, ``steps_to_target``, ``steps`` (its step budget: the
    schedule of every row), ``step_ms`` (its median step), ``bandwidth_mbit`` and
    ``git_commit`` of that sweep, ``world_size``, and ``source`` (``path``). With repeats, the
    first run.

    Raises:
        ValueError: the file cannot be read, or a workload has no such FP16 row there, or its
            FP16 row did not reach its target, or ran on another number of workers than
            ``world_size`` (when given: its steps would not be this sweep's) (named).
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--fp16-reference {path}: cannot read a sweep's results.json ({e})") from None
    sweep = data.get("sweep") or {}
    network = sweep.get("network") or {}
    out = {}
    for w in workloads:
        rows = [r for r in data.get("runs") or [] if r.get("workload") == w and r.get("system") == "horovod"
                and is_fp16_row(r) and not is_reference(r) and r.get("status") == "ok"]
        if not rows:
            raise ValueError(f"--fp16-reference {path}: no FP16 row of workload {w} that finished")
        r = rows[0]
        if r.get("steps_to_target") is None or r.get("final_metric") is None or not r.get("target_vs_fp16"):
            raise ValueError(f"--fp16-reference {path}: FP16's row of {w} has no FP16-relative target it "
                             f"reached (steps to target {r.get('steps_to_target')}, target_vs_fp16 "
                             f"{r.get('target_vs_fp16')}); the estimate needs both")
        if world_size is not None and r.get("world_size") is not None and int(r["world_size"]) != int(world_size):
            raise ValueError(f"--fp16-reference {path}: its FP16 row of {w} ran on {r['world_size']} workers, this "
                             f"sweep on {world_size}: its steps to target are not this sweep's")
        out[w] = {"final_metric": float(r["final_metric"]), "world_size": r.get("world_size"), "target_vs_fp16": float(r["target_vs_fp16"]),
                  "target": float(r["target_vs_fp16"]) * float(r["final_metric"]),
                  "steps_to_target": int(r["steps_to_target"]), "steps": int(r["steps"]),
                  "step_ms": r.get("step_ms_median"), "bandwidth_mbit": network.get("bandwidth_mbit"),
                  "git_commit": sweep.get("git_commit"), "source": str(path)}
    return out


def fp16_flags(reference, early_steps):
    """The FP16 run's worker flags on the slow link: ``--max-steps N --schedule-steps S`` (N =
    ``early_steps``, S = the reference FP16's steps, so its learning rate follows the
    reference's schedule).

    Raises:
        ValueError: ``early_steps`` < 1.
    """
    if not isinstance(early_steps, int) or early_steps < 1:
        raise ValueError(f"--fp16-steps must be an integer >= 1, got {early_steps!r}")
    return ["--max-steps", str(early_steps), "--schedule-steps", str(reference["steps"])]


def reference_meta(reference, early_steps):
    """What the FP16 run keeps (``meta["fp16_estimate"]``): the reference and the early stop."""
    return dict(reference, early_steps=int(early_steps))


def _median_step_s(result):
    """The run's median step (seconds: compute + codec + comm), None without steps."""
    import statistics
    s = result.get("steps") or {}
    if not s.get("step"):
        return None
    return statistics.median(c + k + m for c, k, m in zip(s["compute_s"], s["codec_s"], s["comm_s"]))


def estimated_tta(result):
    """``(tta_s, steps_to_target)`` of an FP16 run stopped early (``meta["fp16_estimate"]``):
    the reference's steps to target times this run's median step time; None when the run has
    no estimate or no steps."""
    est = (result.get("meta") or {}).get("fp16_estimate")
    step_s = _median_step_s(result) if est else None
    if step_s is None:
        return None
    return est["steps_to_target"] * step_s, est["steps_to_target"]


def stop_values(result, cap):
    """The stops of the rows after an FP16 run stopped early (``tta_run.note_fp16``'s dict): the
    reference's target and schedule length, the estimated TTA and ``cap`` x it; None when the
    run has no estimate."""
    est = (result.get("meta") or {}).get("fp16_estimate")
    tta = estimated_tta(result) if est else None
    if tta is None or not math.isfinite(tta[0]):
        return None
    return {"target": est["target"], "fp16_tta_s": tta[0], "cap": cap, "max_seconds": cap * tta[0],
            "fp16_steps": est["steps"], "estimated": True}


def cell_text(row, key, text):
    """The table's cell for an estimated FP16 row: ``TTA s`` marked ``(est.)``, ``steps to
    target`` marked with the reference's link; other cells unchanged."""
    est = row.get("fp16_estimate")
    if not est:
        return text
    if key == "tta_s" and row.get("tta_s") is not None:
        return f"{text} (est.)"
    if key == "steps_to_target" and row.get("steps_to_target") is not None:
        bw = est.get("bandwidth_mbit")
        return f"{row['steps_to_target']:.0f} at {bw:g} Mbit/s" if bw else f"{row['steps_to_target']:.0f} (reference)"
    return text


def header_note(rows):
    """The sentence above the table for estimated FP16 rows ("" without)."""
    out = []
    for r in rows:
        est = r.get("fp16_estimate")
        if not est:
            continue
        bw = est.get("bandwidth_mbit")
        here = r.get("bandwidth_mbit")
        at = f"at {bw:g} Mbit/s" if bw else "in the reference sweep"
        commit = (est.get("git_commit") or "")[:7]
        ms = r.get("step_ms_median")
        out.append(f"{r.get('label')} ({r.get('workload')}) stopped after {est['early_steps']} steps"
                   f"{f' at {here:g} Mbit/s' if here else ''}: its TTA (est.) is its steps to target {at} "
                   f"({est['steps_to_target']}, the sweep in {est['source']}{f' at {commit}' if commit else ''}) "
                   f"times its median step time measured here ({'-' if ms is None else f'{ms:.0f}'} ms); the "
                   f"target ({est['target_vs_fp16']:g} x that run's final rolling metric {est['final_metric']:.4g}) "
                   f"and the rows' learning-rate schedule ({est['steps']} steps) are that run's.")
    return " ".join(out)
