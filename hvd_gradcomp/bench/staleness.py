"""What one step of staleness costs in steps, apart from the link and the codec (simulated).

    python -m hvd_gradcomp.bench staleness --workers 2 --variants "blocking,delay,delay+predict,delay+eager"

N virtual ranks in one process train ``lm-comm`` (its model, data shards, AdamW recipe and
cosine schedule, :class:`.workers.torch_workloads.LMCommWorkload`); each rank computes its own
micro-batch's gradient, and the exact float32 mean (no codec, no link: staleness alone) is
applied by one of these rules (issue 49):

- ``blocking``: step t applies step t's mean (plain data parallel, the reference);
- ``delay``: step t applies step t - 1's mean, zeros at the first step: what
  ``register_comm_hook(..., delay=1)`` and ``fsdp.install(..., delay=1)`` apply with an exact
  codec (CO2, ICLR 2024; PCCL's async DiLoCo);
- ``delay+predict``: ``delay``, with each step's forward and backward run at the extrapolated
  weights ``w_t + (w_t - w_{t-1})`` and the weights put back before the optimizer step, so
  that the mean applied at step t + 1 was taken near ``w_{t+1}`` (weight prediction, as in
  PipeMare, Yang et al. 2021, and SpecTrain, Chen et al. 2018); the ranks stay equal;
- ``delay+eager``: every rank applies ``mean_{t-1} - g_{r,t-1} / N + g_{r,t} / N``, its own
  part fresh and only the others' stale (eager updates, arXiv 2502.12996, applied to the
  gradient); the ranks' weights drift apart, and the table gives the largest difference.

The blocking run takes the schedule's steps (``--max-epochs`` of rank 0's shard), evaluating
the validation perplexity of rank 0's weights every ``--eval-every`` steps; the target is
``--target-vs-blocking`` (1.02, the harness's ``target_vs_fp16``) times its final rolling mean
of 5 evaluations (the harness's rule, :func:`.worker.rolling_mean`). Every other variant then
runs until its rolling mean reaches the target or for ``--overrun`` times the schedule's steps
(at the schedule's final learning rate past its end, as the harness's rows that outlast FP16's
budget), and steps to target is the first evaluation that reached it. Results are simulated
(one process, no link), one seed; they measure convergence, never time.
"""
import argparse
import copy
import json
import math
import os
import subprocess
import sys
import time

import torch

from .worker import rolling_mean

VARIANTS = ("blocking", "delay", "delay+predict", "delay+eager")

__all__ = ["VARIANTS", "train", "run_variant", "steps_to", "render", "main"]


def _check_variant(name):
    if name not in VARIANTS:
        raise ValueError(f"staleness: unknown variant {name!r}; expected one of {', '.join(VARIANTS)}")
    return name


def run_variant(variant, workers, max_epochs=1.75, batch_size=16, seed=0, eval_every=20, lr=2e-3,
                max_steps=None, log=None, target=None, overrun=1.0, window=5):
    """:func:`train`'s result dict alone."""
    return train(variant, workers, max_epochs, batch_size, seed, eval_every, lr, max_steps, log,
                 target, overrun, window)[0]


def train(variant, workers, max_epochs=1.75, batch_size=16, seed=0, eval_every=20, lr=2e-3,
          max_steps=None, log=None, target=None, overrun=1.0, window=5):
    """Train ``lm-comm`` with ``workers`` virtual ranks under ``variant``'s rule (module docs):
    the schedule's steps (or ``max_steps``, when fewer) times ``overrun``, stopping at the first
    evaluation whose rolling mean of ``window`` is at most ``target`` (None: no stop).

    Returns ``(result, models)``: the models (one, or one per rank for ``delay+eager``) and a
    dict: variant, workers, steps (taken), evals ([[step, perplexity], ...], the first at
    step 0), divergence (the largest absolute difference between rank 0's and the last rank's
    weights at the end; 0.0 where the ranks share their weights), seconds (wall clock).

    Raises:
        ValueError: an unknown ``variant``, ``workers`` < 1, ``max_epochs`` <= 0, ``overrun`` < 1.
    """
    from .workers.torch_workloads import LMCommWorkload

    _check_variant(variant)
    if workers < 1 or max_epochs <= 0 or overrun < 1:
        raise ValueError(f"staleness: workers must be >= 1, max_epochs > 0 and overrun >= 1, got {workers}, "
                         f"{max_epochs}, {overrun}")
    data = [LMCommWorkload(r, workers, seed, batch_size) for r in range(workers)]
    torch.manual_seed(seed)
    models = [data[0].model()]
    eager = variant == "delay+eager"
    if eager:  # each rank keeps its own weights (and optimizer state)
        models += [copy.deepcopy(models[0]) for _ in range(workers - 1)]
    total = math.ceil(max_epochs * data[0].steps_per_epoch)
    steps = math.ceil(min(total, max_steps or total) * overrun)  # max_steps: the blocking run's length
    opts = [data[0].optimizer(list(m.named_parameters()), lr) for m in models]
    schedules = [data[0].schedule(o, total) for o in opts]
    params = [list(m.parameters()) for m in models]

    def evaluate():
        models[0].eval()
        sums = [w.evaluate(models[0]) for w in data]
        models[0].train()
        return math.exp(sum(s for s, _ in sums) / sum(c for _, c in sums))

    evals, held, own_prev, before = [[0, evaluate()]], None, None, None
    streams, epoch, step, t0 = [w.batches(0) for w in data], 0, 0, time.time()
    while step < steps:
        try:
            batches = [next(s) for s in streams]
        except StopIteration:
            epoch += 1
            streams = [w.batches(epoch) for w in data]
            continue
        step += 1
        saved = None
        if variant == "delay+predict" and before is not None:
            saved = [p.detach().clone() for p in params[0]]
            with torch.no_grad():
                for p, b in zip(params[0], before):
                    p.add_(p - b)
        grads = []
        for r, (x, y) in enumerate(batches):
            m = models[r if eager else 0]
            m.zero_grad(set_to_none=True)
            data[r].loss(m, x, y).backward()
            grads.append([p.grad.detach().clone() for p in m.parameters()])
        if saved is not None:
            with torch.no_grad():
                for p, s in zip(params[0], saved):
                    p.copy_(s)
        if variant == "delay+predict":
            before = [p.detach().clone() for p in params[0]]
        mean = [sum(g[i] for g in grads) / workers for i in range(len(grads[0]))]
        if variant == "blocking":
            applied = [mean] * len(models)
        elif variant in ("delay", "delay+predict"):
            applied = [held if held is not None else [torch.zeros_like(t) for t in mean]] * len(models)
        else:  # delay+eager: the own part fresh, the others' one step old
            applied = [[g / workers for g in grads[r]] if held is None else
                       [h - o / workers + g / workers for h, o, g in zip(held, own_prev[r], grads[r])]
                       for r in range(workers)]
            own_prev = grads
        held = mean
        for r, (opt, schedule) in enumerate(zip(opts, schedules)):
            for p, g in zip(params[r], applied[r]):
                p.grad = g.clone()
            schedule.set(step)
            opt.step()
        if step % eval_every == 0 or step == steps:
            evals.append([step, evaluate()])
            if log is not None:
                log(f"staleness {variant} N={workers}: step {step}/{steps}, perplexity {evals[-1][1]:.3f}")
            if target is not None and steps_to(evals, target, window) is not None:
                break
    divergence = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(params[0], params[-1]))
    return {"variant": variant, "workers": workers, "steps": step, "evals": evals, "divergence": divergence,
            "seconds": time.time() - t0, "batch_size": batch_size, "max_epochs": max_epochs, "seed": seed,
            "schedule_steps": total, "target": target}, models


def steps_to(evals, target, window=5):
    """The step of the first evaluation whose rolling mean (``window``) is <= ``target``, or
    None. ``evals``: [[step, perplexity], ...]; the step-0 evaluation is left out of the mean."""
    points = [e for e in evals if e[0] > 0]
    rolled = rolling_mean([v for _, v in points], window)
    return next((s for (s, _), r in zip(points, rolled) if r <= target), None)


def render(results, target_vs_blocking=1.02, window=5):
    """A markdown table per worker count: final rolling perplexity, steps to the target (the
    blocking run's final rolling perplexity x ``target_vs_blocking``) and against blocking's.
    Raises ValueError when a worker count has no ``blocking`` run (it sets the target)."""
    lines = []
    for n in sorted({r["workers"] for r in results}):
        rows = [r for r in results if r["workers"] == n]
        base = next((r for r in rows if r["variant"] == "blocking"), None)
        if base is None:
            raise ValueError(f"staleness: N={n} has no blocking run, which sets the target")
        final = {id(r): rolling_mean([v for s, v in r["evals"] if s > 0], window)[-1] for r in rows}
        target = target_vs_blocking * final[id(base)]
        base_steps = steps_to(base["evals"], target, window)
        schedule = base.get("schedule_steps", base["steps"])
        cut = f", blocking stopped at {base['steps']} (--max-steps)" if base["steps"] < schedule else ""
        lines += [f"N = {n}: target {target:.3f} ({target_vs_blocking} x blocking's final rolling perplexity over "
                  f"{window} evaluations), a schedule of {schedule} steps{cut}, batch {base['batch_size']} a rank, "
                  f"seed {base['seed']}", "",
                  "| variant | steps run | rolling perplexity at the end | steps to target | vs blocking | "
                  "ranks' largest weight difference |",
                  "|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: VARIANTS.index(r["variant"])):
            s = steps_to(r["evals"], target, window)
            ratio = f"{s / base_steps:.2f}x" if s and base_steps else "-"
            lines.append(f"| {r['variant']} | {r['steps']} | {final[id(r)]:.3f} | "
                         f"{s if s else 'not reached in ' + str(r['steps'])} | "
                         f"{ratio} | {r['divergence']:.3g} |")
        lines.append("")
    return "\n".join(lines)


def _commit():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m hvd_gradcomp.bench staleness", description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2", help="comma-separated virtual rank counts (default 2)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default: all; blocking always runs first)")
    p.add_argument("--max-epochs", type=float, default=1.75, help="the schedule's length in epochs (lm-comm's 1.75)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop the blocking run after this many steps, the others after --overrun times as "
                        "many (a quick look; the schedule keeps its length)")
    p.add_argument("--batch-size", type=int, default=16, help="per rank (lm-comm's 16)")
    p.add_argument("--eval-every", type=int, default=20, help="steps between evaluations (default 20)")
    p.add_argument("--seed", type=int, default=0, help="default 0")
    p.add_argument("--target-vs-blocking", type=float, default=1.02,
                   help="the target: this times the blocking run's final rolling perplexity (default 1.02)")
    p.add_argument("--overrun", type=float, default=3.0,
                   help="the other variants run at most this many times the blocking run's steps (default 3)")
    p.add_argument("--out", default="runs/staleness", help="one JSON per run, reused when its options match")
    p.add_argument("--update-doc", default=None, help="write the table into this file's block")
    p.add_argument("--doc-block", default="staleness", help="the block's name (default staleness)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    variants = [_check_variant(v.strip()) for v in args.variants.split(",") if v.strip()]
    if "blocking" not in variants:
        p.error("--variants must include blocking (it sets the target)")
    os.makedirs(args.out, exist_ok=True)
    commit = _commit()
    results = []
    for n in [int(w) for w in args.workers.split(",")]:
        target = None  # from this N's blocking run, which runs first
        for v in ["blocking"] + [v for v in variants if v != "blocking"]:
            tail = "" if v == "blocking" else f"-o{args.overrun:g}-t{args.target_vs_blocking:g}"
            path = os.path.join(args.out, f"{v.replace('+', '-')}-n{n}-s{args.seed}-e{args.max_epochs:g}"
                                          f"-b{args.batch_size}-m{args.max_steps or 0}-v{args.eval_every}{tail}.json")
            if os.path.exists(path):
                with open(path) as f:
                    r = json.load(f)
            else:
                r = run_variant(v, n, args.max_epochs, args.batch_size, args.seed, args.eval_every,
                                max_steps=args.max_steps, log=lambda m: print(m, file=sys.stderr, flush=True),
                                target=target, overrun=1.0 if v == "blocking" else args.overrun)
                r["commit"] = commit
                with open(path, "w") as f:
                    json.dump(r, f)
            if v == "blocking":
                target = args.target_vs_blocking * rolling_mean([e[1] for e in r["evals"] if e[0] > 0], 5)[-1]
            results.append(r)
    table = render(results, args.target_vs_blocking)
    commits = sorted({r.get("commit", "unknown")[:12] for r in results})
    given = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
             if k not in ("out", "update_doc", "doc_block") and v != p.get_default(k)]
    table += (f"\nSimulated (one process, no link, exact float32 mean), lm-comm's AdamW recipe; "
              f"commit {', '.join(commits)}; `python -m hvd_gradcomp.bench staleness {' '.join(given)}`.\n")
    print(table)
    if args.update_doc:
        from .report import update_doc
        update_doc(args.update_doc, table, args.doc_block)
    return 0
