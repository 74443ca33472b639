"""``python -m hvd_gradcomp.bench scale``: steps to FP16's target at N ranks, simulated in one
process with the real codec, and time to accuracy (TTA) from measured parts and the ring model.

What it does:

1. **Simulated training** (:func:`simulate`): a TTA workload (``lm-comm`` by default; also
   ``lm-shakespeare``, the same model on Shakespeare's texts, :func:`.data.shakespeare_corpus`)
   trained with N virtual ranks through :class:`torch_backend.simulated.SimulatedEngine`:
   rank r draws its own micro-batch (the harness's data order: shard r of N of each epoch's
   permutation, ``--batch-size`` per rank at every N, as in data parallel), the one model
   computes each rank's gradient in turn, each rank's own compressor (own state and random
   streams) encodes it, the payloads are reduced as the collective would (integers exactly,
   floats in ring order), every rank decodes (the ranks' results are checked equal), and one
   optimizer step is taken on the decoded mean. The layout is Horovod's default path (one codec
   call and payload per parameter, ``op=Average``: ``--layout tensor``), so N = 2 and 4 can be
   checked against real Horovod runs; ``--layout bucket`` sends the whole gradient as one DDP
   bucket (``op=Sum``). The learning-rate schedule, budget (``--max-epochs`` x steps per epoch
   at N) and evaluations are the harness's; evaluations come every ``eval_every x 2 / N`` steps
   (the workload's interval at 2 ranks, in training windows), on the whole validation set.
2. **Targets**: FP16 runs its budget first at each N; every other row's target is 1.02 x FP16's
   final rolling perplexity at that N (the harness's rule for ``lm-comm``), and it stops at
   the first evaluation whose rolling mean reaches it, or at ``--cap`` x the budget.
3. **Modelled TTA** = steps to target x a step time from measured parts (:mod:`.model`'s
   :func:`~.model.predict_step_time`): the compute of one rank (its forward and backward, the
   median over steps, plus the optimizer step), the codec time of one rank (encode + decode,
   summed over ranks / N, median over steps), and the ring all-reduce of the payload bytes
   measured at that N (THC's lanes widen with N) on links of ``--gbps``, without overlap and
   with the all-reduce hidden behind ``--overlap`` x the compute. The compute and codec times
   are this machine's (one CPU thread), not a GPU's: the table says so.
4. **Validation** (``--validate 2,4``): at those N, the real harness
   (``python -m hvd_gradcomp.bench tta``, Horovod on loopback, the same seed, budget and data
   order) runs ``--validate-rows``; the simulated and real steps to target and bytes per step
   are printed side by side (steps within 10%, bytes equal exactly: ``ok``).

Results: one JSON per run in ``--out`` (default ``runs/scale``; a run already there is reused,
so a sweep resumes), and the Markdown blocks ``scale-validation`` and ``scale-sweep`` (or the
name ``--sweep-block`` gives, for a second sweep beside the first) printed and, with
``--update-doc FILE``, written between ``<!-- NAME:start/end -->`` in FILE.
"""
import argparse
import copy
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

import torch

from hvd_gradcomp.buckets import Member
from torch_backend.simulated import SimulatedEngine

from . import data, report, scale_gpu, scale_local
from .scale_tables import (BASELINE, stop_reason, TARGET_VS_FP16, TOLERANCE, WINDOW, final_metric, modelled_tta,  # noqa: F401
                           step_parts, steps_to_target, sweep_block, validation_block)
from .worker import rolling_mean
from .workers import torch_workloads

__all__ = ["ShakespeareWorkload", "WORKLOADS", "simulate", "steps_to_target", "sweep", "validate",
           "modelled_tta", "sweep_block", "validation_block", "main", "ROWS", "VALIDATE_ROWS",
           "gpu_scaling", "model_params", "THC_4_LEVELS"]

# THC with 4 levels a rank: without error feedback and with lanes for the other ranks, as
# docs/thc.md and tta.ADAM_ROWS run it (its saturation rate the default, which counts the ranks)
THC_4_LEVELS = "thc:bits=2,error_feedback=false,subtract_own=true"
ROWS = ("fp16", "thc", "topkc:ratio=0.1", "bf16", "thc:error_feedback=false", THC_4_LEVELS,
        "powersgd:rank=4", "signsgd")
VALIDATE_ROWS = ("fp16", "thc", "topkc:ratio=0.1")


ShakespeareWorkload = torch_workloads.ShakespeareWorkload  # lm-shakespeare (also in the real harness)
WORKLOADS = {"lm-comm": torch_workloads.LMCommWorkload, "lm-shakespeare": ShakespeareWorkload}


def _rank_view(workload, rank):
    """``workload`` as rank ``rank`` sees it (its batches: shard ``rank`` of each epoch)."""
    view = copy.copy(workload)
    view.rank = rank
    return view


def eval_every_at(n, eval_every, ranks=2):
    """Steps between evaluations at N ranks: ``eval_every`` at ``ranks`` ranks, in windows."""
    return max(1, round(eval_every * ranks / n))


def simulate(workload, spec, n, *, seed=0, batch_size=16, max_epochs=1.0, lr=None, layout="tensor",
             target=None, cap=1.0, eval_every=None, max_steps=0, log=None):
    """One simulated run of ``spec`` on ``n`` virtual ranks (module docstring, step 1).

    Args:
        workload: a key of :data:`WORKLOADS`.
        spec: the compressor spec (every rank builds its own).
        n: ranks.
        seed, batch_size, lr: the harness's flags (``lr`` None: the workload's default).
        max_epochs: the budget in epochs at N (the learning-rate schedule's length).
        layout: ``"tensor"`` (Horovod's per-parameter calls, op Average) or ``"bucket"``.
        target: stop at the first evaluation whose rolling mean reaches it (None: run the budget).
        cap: with a target, run at most ``cap`` x the budget's steps.
        eval_every: steps between evaluations (None: :func:`eval_every_at` of the workload's).
        max_steps: a hard cap on steps (0: none; tests).
        log: ``callable(str)`` for progress lines, or None.

    Returns a dict: the configuration, ``evals`` ({"step", "metric"}), ``steps_run``,
    ``stop_reason``, ``bytes`` (rank 0's ``bytes_per_step()``), ``compute_s``/``codec_s``
    (medians per step: one rank's), ``ranks_agree`` (every rank decoded the same mean at every
    step), ``wall_s``.

    Raises:
        ValueError: an unknown workload or layout, or what the compressor refuses.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"scale: workload must be one of {sorted(WORKLOADS)}, got {workload!r}")
    if layout not in ("tensor", "bucket"):
        raise ValueError(f"scale: layout must be 'tensor' or 'bucket', got {layout!r}")
    cls = WORKLOADS[workload]
    lr = cls.defaults["lr"] if lr is None else lr
    eval_every = eval_every or eval_every_at(n, cls.defaults["eval_every"])
    wall0 = time.time()
    torch.manual_seed(seed)
    wl = cls(0, n, seed, batch_size)
    judge = cls(0, 1, seed, batch_size)  # the whole validation set (the ranks' shards, summed)
    model = wl.model()
    opt = torch_workloads.build_optimizer(wl, model.parameters(), lr, "")
    budget = int(math.ceil(max_epochs * wl.steps_per_epoch))
    schedule = wl.schedule(opt, budget) if hasattr(wl, "schedule") else None
    limit = budget if target is None else int(math.ceil(cap * budget))
    if max_steps:
        limit = min(limit, max_steps)
    if scale_local.is_update_sync(spec):
        if layout != "tensor":
            raise ValueError(f"scale: {spec!r}: update-sync rows run in the tensor layout only")
        part = scale_local.simulate_update_sync(cls, spec, n, seed=seed, batch_size=batch_size, lr=lr,
                                                budget=budget, limit=limit, eval_every=eval_every,
                                                target=target, log=log)
        return dict({"workload": workload, "spec": spec, "n": n, "layout": layout, "seed": seed,
                     "batch_size": batch_size, "lr": lr, "max_epochs": max_epochs, "budget_steps": budget,
                     "eval_every": eval_every, "window": WINDOW, "target": target, "cap": cap,
                     "wall_s": time.time() - wall0, "threads": torch.get_num_threads()}, **part)
    engine = SimulatedEngine(n, op="average" if layout == "tensor" else "sum")
    comps = engine.compressors(spec)
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    buckets, offset = [], 0  # (offset, size, members) of each all-reduce
    for k, p in named:
        if layout == "tensor":
            buckets.append((offset, p.numel(), [Member(k, k, tuple(p.shape), 0, p.numel())]))
        offset += p.numel()
    if layout == "bucket":
        members, o = [], 0
        for k, p in named:
            members.append(Member(k, k, tuple(p.shape), o, p.numel()))
            o += p.numel()
        buckets.append((0, offset, members))
    ranks = [_rank_view(wl, r) for r in range(n)]
    epoch, iters = 0, [v.batches(0) for v in ranks]
    evals = {"step": [], "metric": []}
    compute, codec, agree, stop, step = [], [], True, None, 0

    def evaluate():
        model.eval()
        total, count = judge.evaluate(model)
        model.train()
        evals["step"].append(step)
        evals["metric"].append(judge.metric(total, count))
        return rolling_mean(evals["metric"], WINDOW)[-1]

    evaluate()
    while stop is None:
        grads, t_fb = [], 0.0
        for r in range(n):
            try:
                x, y = next(iters[r])
            except StopIteration:  # every rank's shard has the same length: a new epoch for all
                epoch += 1
                iters = [v.batches(epoch) for v in ranks]
                x, y = next(iters[r])
            t0 = time.perf_counter()
            for _, p in named:
                p.grad = None
            wl.loss(model, x, y).backward()
            t_fb += time.perf_counter() - t0
            grads.append(torch.cat([p.grad.reshape(-1) for _, p in named]))
        step += 1
        engine.take_timings()
        mean = torch.empty_like(grads[0])
        for off, size, members in buckets:
            outs = engine.allreduce_bucket(comps, [g[off:off + size] for g in grads], members)
            agree = agree and all(torch.equal(outs[0], o) for o in outs[1:])
            mean[off:off + size] = outs[0]
        times = engine.take_timings()
        codec.append((sum(times["encode_s"]) + sum(times["decode_s"])) / n)
        o = 0
        for _, p in named:
            p.grad = mean[o:o + p.numel()].view_as(p)
            o += p.numel()
        if schedule is not None:
            schedule.set(step)
        t0 = time.perf_counter()
        opt.step()
        compute.append(t_fb / n + time.perf_counter() - t0)
        if step % eval_every == 0 or step >= limit or step == budget:
            roll = evaluate()
            stop = stop_reason(evals["metric"][-1], roll, target, step, limit, budget)
            if log:
                log(f"  {spec} N={n} step {step}/{limit} ppl {evals['metric'][-1]:.3f} (rolling {roll:.3f})")
    w = comps[0].bytes_per_step()
    return {"workload": workload, "spec": spec, "n": n, "layout": layout, "seed": seed,
            "batch_size": batch_size, "lr": lr, "max_epochs": max_epochs, "budget_steps": budget,
            "steps_per_epoch": wl.steps_per_epoch, "eval_every": eval_every, "window": WINDOW,
            "target": target, "cap": cap, "steps_run": step, "stop_reason": stop, "evals": evals,
            "bytes": {"payload": w.payload, "side": w.side, "side_collectives": w.side_collectives},
            "compute_s": statistics.median(compute), "codec_s": statistics.median(codec),
            "ranks_agree": bool(agree), "wall_s": time.time() - wall0, "threads": torch.get_num_threads()}


def calibrate(workload, spec, n, *, batch_size=16, reps=3, seed=0, layout="tensor"):
    """Step parts measured apart from training, each the fastest of ``reps`` repeats (after one
    warm-up), in this thread's CPU time (``time.thread_time``, PyTorch on one thread), so that
    other jobs on a shared machine do not inflate them: ``{"compute_s": one rank's
    forward + backward + optimizer step, "codec_s": one rank's encode + decode (the N ranks'
    summed / N)}``, seconds, on rank r's real micro-batches of the first epoch."""
    if scale_local.is_update_sync(spec):  # one sync's codec (the change's, as large as a gradient) / H
        inner, options = scale_local.parse(spec)
        out = calibrate(workload, inner, n, batch_size=batch_size, reps=reps, seed=seed, layout=layout)
        return dict(out, codec_s=out["codec_s"] / int(options.get("every", 1)))
    cls = WORKLOADS[workload]
    torch.manual_seed(seed)
    wl = cls(0, n, seed, batch_size)
    model = wl.model()
    opt = torch_workloads.build_optimizer(wl, model.parameters(), cls.defaults["lr"], "")
    engine = SimulatedEngine(n, op="average" if layout == "tensor" else "sum", clock=time.thread_time)
    comps = engine.compressors(spec)
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    offsets, o = [], 0
    for k, p in named:
        offsets.append((o, [Member(k, k, tuple(p.shape), 0 if layout == "tensor" else o, p.numel())]))
        o += p.numel()
    buckets = [(off, m[0].numel, m) for off, m in offsets] if layout == "tensor" else \
        [(0, o, [m[0] for _, m in offsets])]
    iters = [_rank_view(wl, r).batches(0) for r in range(n)]
    compute, codec = [], []
    for _ in range(reps + 1):
        grads, fb = [], []
        for r in range(n):
            x, y = next(iters[r])
            t0 = time.thread_time()
            for _, p in named:
                p.grad = None
            wl.loss(model, x, y).backward()
            fb.append(time.thread_time() - t0)
            grads.append(torch.cat([p.grad.reshape(-1) for _, p in named]))
        engine.take_timings()
        for off, size, members in buckets:
            engine.allreduce_bucket(comps, [g[off:off + size] for g in grads], members)
        t = engine.take_timings()
        t0 = time.thread_time()
        opt.step()
        compute.append(min(fb) + time.thread_time() - t0)
        codec.append((sum(t["encode_s"]) + sum(t["decode_s"])) / n)
    return {"compute_s": min(compute[1:]), "codec_s": min(codec[1:]), "reps": reps}


def _run_file(out, workload, spec, n, layout, max_epochs):
    safe = spec.replace(":", "-").replace(",", "_").replace("=", "").replace(" ", "_").replace("(", "").replace(")", "")
    return os.path.join(out, f"{workload}-{layout}-e{max_epochs:g}-N{n}-{safe}.json")


def _run_or_load(out, workload, spec, n, opts, target, log):
    path = _run_file(out, workload, spec, n, opts.layout, opts.max_epochs)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    if getattr(opts, "cached", False):
        return None
    log(f"simulating {workload} {spec} at N={n}")
    res = simulate(workload, spec, n, seed=opts.seed, batch_size=opts.batch_size,
                   max_epochs=opts.max_epochs, layout=opts.layout, target=target, cap=opts.cap,
                   log=log if opts.verbose else None)
    os.makedirs(out, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(path + ".tmp", path)
    log(f"  {spec} N={n}: {res['stop_reason']} at step {res['steps_run']} ({res['wall_s']:.0f} s)")
    return res


def sweep(opts, workers, rows, log=print):
    """Every row at every N: ``{n: {spec: result}}``. FP16 first at every N (it sets the others'
    target), then each row at every N in turn, so that a sweep cut short by ``opts.deadline_s``
    (no run starts after it) holds whole rows."""
    t0 = time.time()
    out = {n: {BASELINE: _run_or_load(opts.out, opts.workload, BASELINE, n, opts, None, log)} for n in workers}
    for spec in rows:
        if spec == BASELINE:
            continue
        for n in workers:
            if opts.deadline_s and time.time() - t0 > opts.deadline_s:
                log(f"deadline reached: {spec} at N={n} and later runs left out")
                return out
            if out[n][BASELINE] is None:
                continue
            target = TARGET_VS_FP16 * final_metric(out[n][BASELINE])
            res = _run_or_load(opts.out, opts.workload, spec, n, opts, target, log)
            if res is not None:
                out[n][spec] = res
    return {n: rows for n, rows in sorted(out.items()) if rows[BASELINE] is not None}


def _calibrations(opts, results, log):
    """``{(n, spec): calibrate(...)}`` for every row of ``results`` at each N of ``--calibrate-at``,
    cached in ``--out``."""
    out = {}
    specs = list(dict.fromkeys(spec for rows in results.values() for spec in rows))
    for n in _ints(opts.calibrate_at):  # (also where no run is: the rows above take it)
        for spec in specs:
            path = _run_file(opts.out, opts.workload, spec, n, opts.layout, opts.max_epochs)[:-5] + ".calib.json"
            if not os.path.exists(path):  # (--cached too: --calibrate asks for it)
                log(f"calibrating {spec} at N={n}")
                with open(path, "w") as f:
                    json.dump(calibrate(opts.workload, spec, n, batch_size=opts.batch_size, seed=opts.seed,
                                        layout=opts.layout), f)
            with open(path) as f:
                out[(n, spec)] = json.load(f)
    return out


def _real_runs(n, rows, opts, log):
    """The real harness at ``n`` ranks (Horovod, loopback): ``{spec: result of the worker}``."""
    folder = os.path.join(opts.out, f"real-{opts.workload}-e{opts.max_epochs:g}-N{n}")
    path = os.path.join(folder, "results.json")
    if not os.path.exists(path) and getattr(opts, "cached", False):
        return {}
    if not os.path.exists(path):
        cmd = [sys.executable, "-m", "hvd_gradcomp.bench", "tta", "--workloads", opts.workload,
               "--compressors", ";".join(rows), "--workers", str(n), "--loopback", "--skip-link-check",
               "--budget-epochs", f"{opts.max_epochs:g}", "--seed", str(opts.seed), "--out", folder,
               "--no-progress", "--worker-args",
               f"--batch-size {opts.batch_size} --eval-every {eval_every_at(n, WORKLOADS[opts.workload].defaults['eval_every'])}"]
        log("real harness: " + " ".join(cmd))
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(path):
            raise RuntimeError(f"scale --validate: the real harness failed (exit {done.returncode}): "
                               f"{done.stdout[-1500:]}{done.stderr[-1500:]}")
    with open(path) as f:
        saved = json.load(f)
    return {res["meta"]["compression"]: res for res in saved["results"].values() if res.get("meta")}


def validate(opts, workers, rows, log=print):
    """``[(n, spec, simulated result, its target, real result, its target)]``: each row at each
    N, simulated and run for real (module docstring, step 4)."""
    out = []
    for n in workers:
        sims = {BASELINE: _run_or_load(opts.out, opts.workload, BASELINE, n, opts, None, log)}
        if sims[BASELINE] is None:  # --cached, not run
            continue
        sim_target = TARGET_VS_FP16 * final_metric(sims[BASELINE])
        for spec in rows:
            if spec != BASELINE:
                sims[spec] = _run_or_load(opts.out, opts.workload, spec, n, opts, sim_target, log)
        real = _real_runs(n, rows, opts, log)
        base = real.get(BASELINE)
        real_target = None if base is None else TARGET_VS_FP16 * rolling_mean(
            base["evals"]["metric"], int(base["meta"].get("window", WINDOW)))[-1]
        for spec in rows:
            if sims[spec] is not None:
                out.append((n, spec, sims[spec], sim_target, real.get(spec), real_target))
    return out


def model_params(workload):
    """Trainable parameters of ``workload``'s model (built without its corpus)."""
    shape = scale_gpu.model_shape(WORKLOADS[workload])
    model = torch_workloads.ByteTransformer(shape["context"], shape["width"], 4, shape["layers"])
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def gpu_scaling(opts, results):
    """``{"parts", "label"}`` for :func:`.scale_tables.sweep_block`: the step's compute and
    codec scaled to ``opts.gpu`` (:func:`.scale_gpu.gpu_parts`), and the sentence saying how."""
    gpu = scale_gpu.GPU_CLASSES[opts.gpu]
    shape = scale_gpu.model_shape(WORKLOADS[opts.workload])
    params = model_params(opts.workload)
    flops = scale_gpu.step_flops(params, opts.batch_size, **shape)
    floor_s = opts.gpu_floor_ms * 1e-3
    parts = scale_gpu.gpu_parts(results, gpu, params, flops, opts.gpu_mfu, floor_s)
    compute = flops / (gpu.bf16_tflops * 1e12 * opts.gpu_mfu)
    label = (f"one {gpu.name} ({gpu.bf16_tflops:g} TFLOP/s dense BF16, {gpu.hbm_tbs:g} TB/s): compute = "
             f"{flops / 1e6:.0f} MFLOP a rank's step (6 x {params:,} parameters x {opts.batch_size} x "
             f"{shape['context']} tokens + attention) at {opts.gpu_mfu:.0%} MFU = {compute * 1e6:.1f} us, "
             f"raised to the assumed launch-bound floor of {opts.gpu_floor_ms:g} ms" if compute < floor_s else
             f"one {gpu.name}: compute = {flops / 1e6:.0f} MFLOP at {opts.gpu_mfu:.0%} MFU")
    label += f"; codec = {scale_gpu.CODEC_SOURCE}"
    return {"parts": parts, "label": label}


def _commit():
    from .tta_run import git_commit
    text = git_commit() or "unknown"
    return text[:12] + ("-dirty" if text.endswith("-dirty") else "")


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser():
    p = argparse.ArgumentParser(prog="python -m hvd_gradcomp.bench scale", description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="lm-comm", choices=sorted(WORKLOADS))
    p.add_argument("--workers", default="2,8,16,32,64", help="N values, comma-separated")
    p.add_argument("--compressors", default=";".join(ROWS), help="';'-separated specs (fp16 always first)")
    p.add_argument("--gbps", default="1,10,100", help="link speeds, Gbit/s per rank")
    p.add_argument("--overlap", type=float, default=2 / 3,
                   help="with overlap: the all-reduce hidden behind this fraction of the compute "
                        "(default 2/3: backward's share of forward + backward)")
    p.add_argument("--max-epochs", type=float, default=None, help="budget in epochs at N (default: the workload's)")
    p.add_argument("--batch-size", type=int, default=16, help="per rank, at every N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", choices=("tensor", "bucket"), default="tensor")
    p.add_argument("--cap", type=float, default=1.25, help="rows after FP16 stop at this x the budget")
    p.add_argument("--validate", default="", help="N values to validate against the real harness, e.g. 2,4")
    p.add_argument("--validate-rows", default=";".join(VALIDATE_ROWS))
    p.add_argument("--no-sweep", action="store_true", help="the validation only")
    p.add_argument("--cached", action="store_true",
                   help="run nothing: tables from the runs already in --out (missing ones left out)")
    p.add_argument("--calibrate", action="store_true",
                   help="model the step from compute and codec times measured apart, the fastest of a "
                        "few repeats (calibrate()), instead of the runs' medians (inflated by other jobs)")
    p.add_argument("--calibrate-at", default="2,8",
                   help="N values calibrated (a run at another N takes the largest calibrated N below it)")
    p.add_argument("--gpu", default="h100-sxm", choices=sorted(scale_gpu.GPU_CLASSES) + ["none"],
                   help="also model the step with compute and codec scaled to this GPU class "
                        "(hvd_gradcomp.bench.scale_gpu; 'none': the CPU-measured step only)")
    p.add_argument("--gpu-mfu", type=float, default=0.4,
                   help="the GPU's model-FLOPs utilisation (of its dense BF16 peak) for the compute")
    p.add_argument("--gpu-floor-ms", type=float, default=1.0,
                   help="the GPU compute's floor per step, ms (an assumption: a small model's step is "
                        "kernel-launch bound)")
    p.add_argument("--deadline", type=float, default=0.0, help="stop starting runs after this many minutes")
    p.add_argument("--threads", type=int, default=1, help="PyTorch threads (the workers': 1)")
    p.add_argument("--out", default=os.path.join("runs", "scale"))
    p.add_argument("--update-doc", default=None, help="write the blocks into this Markdown file")
    p.add_argument("--sweep-block", default="scale-sweep",
                   help="the name of the block --update-doc writes the sweep into (between "
                        "<!-- NAME:start/end -->), so that a second sweep (another budget or set of "
                        "N) can stand beside the first")
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv=None):
    parser = build_parser()
    opts = parser.parse_args(argv)
    if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", opts.sweep_block) or opts.sweep_block == "scale-validation":
        parser.error(f"--sweep-block must be lower-case letters, digits and single hyphens, and not "
                     f"'scale-validation' (the validation's block), got {opts.sweep_block!r}")
    if opts.max_epochs is None:
        opts.max_epochs = float(WORKLOADS[opts.workload].defaults["max_epochs"])
    opts.deadline_s = 60.0 * opts.deadline
    torch.set_num_threads(opts.threads)
    gbps = [float(g) for g in opts.gbps.split(",")]
    commit = _commit()
    blocks = {}
    if opts.validate:
        rows = [s.strip() for s in opts.validate_rows.split(";") if s.strip()]
        blocks["scale-validation"] = validation_block(validate(opts, _ints(opts.validate), rows), commit, opts)
        print(blocks["scale-validation"], flush=True)
    if not opts.no_sweep:
        rows = [s.strip() for s in opts.compressors.split(";") if s.strip()]
        results = sweep(opts, _ints(opts.workers), rows)
        calibration = _calibrations(opts, results, print) if opts.calibrate else None
        gpu = None if opts.gpu == "none" else gpu_scaling(opts, results)
        blocks[opts.sweep_block] = sweep_block(results, gbps, opts.overlap, commit, opts, calibration, gpu)
        print(blocks[opts.sweep_block], flush=True)
    if opts.update_doc:
        for name, block in blocks.items():
            report.update_doc(opts.update_doc, block, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
