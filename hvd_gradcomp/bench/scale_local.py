"""The scale study's update-sync rows (``SPEC with update-sync(every=H)``), simulated with N
virtual ranks in one process (:mod:`.scale` runs the gradient rows).

Method, as ``torch_backend.update_sync.UpdateSync`` (its docstring) does on N processes, the
local part per rank and the sync through :class:`torch_backend.simulated.SimulatedEngine`:

- every rank r keeps its own replica of the model (all start from the same initialisation)
  and its own inner optimizer (the workload's: ``lm-comm``'s AdamW with warm-up and cosine
  decay, each rank's schedule set at every step), and steps it on its own micro-batch's
  gradient (shard r of the harness's data order, as :func:`.scale.simulate`);
- every H steps each rank's change since the last sync, ``delta_r = p_r - theta`` (one
  tensor per parameter, keyed by the parameter's name, as UpdateSync encodes it), goes through
  rank r's own compressor (its own error feedback), the payloads are reduced as the collective
  would (``op`` Average, Horovod's default) and every rank decodes the mean ``d`` (checked
  equal on every rank);
- H = 1 without outer options: ``theta <- theta + d``; H > 1: an outer SGD step on
  ``theta`` with gradient ``-d`` (learning rate 0.7, momentum 0.9, Nesterov: DiLoCo's and
  UpdateSync's defaults, or the row's ``outer_lr``/``outer_momentum``/``nesterov``); then every
  replica is set to ``theta``.

Evaluations sum, as the real worker does, each rank's validation shard scored with that rank's
own replica (the replicas differ between syncs). Bytes and codec time per step are one sync's
divided by H (``bytes_per_step``, as UpdateSync's ``bytes_per_step()``). Not validated against
real Horovod runs (the gradient rows are: docs/scale.md); the overlapped sync (``overlap``,
``fragments``) is refused here.
"""
import copy
import statistics
import time

import torch

from hvd_gradcomp.buckets import Member
from torch_backend.simulated import SimulatedEngine

from .scale_tables import WINDOW, stop_reason
from .worker import rolling_mean
from .workers import torch_workloads

__all__ = ["is_update_sync", "parse", "simulate_update_sync"]


def is_update_sync(row):
    """True for a row with an ``update-sync`` clause."""
    return "update-sync" in row


def parse(row):
    """``(spec, options)`` of ``row`` (``"fp16 with update-sync(every=8)"``: ``("fp16",
    {"every": 8})``), by the real harness's parser (:func:`.tta.parse_row`).

    Raises:
        ValueError: not an update-sync row, another clause beside it, or the overlapped sync.
    """
    from .tta import parse_row, parse_update_sync
    r = parse_row(row)
    if r.update_sync is None:
        raise ValueError(f"scale: {row!r} has no update-sync clause")
    if r.optimizer or r.accumulate > 1 or r.groups or r.delay:
        raise ValueError(f"scale: {row!r}: the simulated update sync takes no other clause")
    options = parse_update_sync(r.update_sync)
    if options.get("overlap"):
        raise ValueError(f"scale: {row!r}: the overlapped update sync is not simulated")
    return r.spec, options


def simulate_update_sync(cls, row, n, *, seed, batch_size, lr, budget, limit, eval_every, target,
                         log=None):
    """One simulated run of the update-sync ``row`` on ``n`` ranks (module docstring), for
    :func:`.scale.simulate` (which computed ``budget``, ``limit`` and ``eval_every``).

    Returns the partial result dict :func:`.scale.simulate` completes: ``evals``,
    ``steps_run``, ``stop_reason``, ``bytes`` (per step), ``compute_s``, ``codec_s`` (per
    step), ``ranks_agree``, ``steps_per_epoch``, ``every``.
    """
    spec, options = parse(row)
    every = int(options.get("every", 1))
    local = every > 1 or "outer_lr" in options or "outer_momentum" in options
    torch.manual_seed(seed)
    wl = cls(0, n, seed, batch_size)
    first = wl.model()
    models = [first] + [copy.deepcopy(first) for _ in range(n - 1)]
    opts = [torch_workloads.build_optimizer(wl, m.parameters(), lr, "") for m in models]
    schedules = [wl.schedule(o, budget) if hasattr(wl, "schedule") else None for o in opts]
    named = [[(k, p) for k, p in m.named_parameters() if p.requires_grad] for m in models]
    theta = [p.detach().clone() for _, p in named[0]]
    outer = None
    if local:
        momentum = float(options.get("outer_momentum", 0.9))
        outer = torch.optim.SGD(theta, lr=float(options.get("outer_lr", 0.7)), momentum=momentum,
                                nesterov=bool(options.get("nesterov", True)) and momentum > 0)
    engine = SimulatedEngine(n, op="average")
    comps = engine.compressors(spec)
    every_window = cls(0, 1, seed, batch_size).valid  # the validation sample, before sharding
    views = []
    for r in range(n):  # rank r: its training shard and its validation shard, as on N processes
        v = copy.copy(wl)
        v.rank, v.valid = r, every_window[r::n]
        views.append(v)
    epoch, iters = 0, [v.batches(0) for v in views]
    evals = {"step": [], "metric": []}
    compute, codec, agree, stop, step, sync_codec = [], [], True, None, 0, 0.0

    def evaluate():
        total = count = 0.0
        for r in range(n):  # each rank's shard, scored with its own replica (the real worker's)
            models[r].eval()
            t, c = views[r].evaluate(models[r])
            models[r].train()
            total, count = total + t, count + c
        evals["step"].append(step)
        evals["metric"].append(wl.metric(total, count))
        return rolling_mean(evals["metric"], WINDOW)[-1]

    evaluate()
    while stop is None:
        t_fb = 0.0
        step += 1
        for r in range(n):
            try:
                x, y = next(iters[r])
            except StopIteration:  # every rank's shard has the same length: a new epoch for all
                epoch += 1
                iters = [v.batches(epoch) for v in views]
                x, y = next(iters[r])
            t0 = time.perf_counter()
            for _, p in named[r]:
                p.grad = None
            wl.loss(models[r], x, y).backward()
            if schedules[r] is not None:
                schedules[r].set(step)
            opts[r].step()
            t_fb += time.perf_counter() - t0
        compute.append(t_fb / n)
        if step % every == 0:
            engine.take_timings()
            means = []
            with torch.no_grad():
                for i, (k, p0) in enumerate(named[0]):
                    deltas = [(named[r][i][1] - theta[i]).reshape(-1) for r in range(n)]
                    outs = engine.allreduce_bucket(comps, deltas, [Member(k, k, tuple(p0.shape), 0, p0.numel())])
                    agree = agree and all(torch.equal(outs[0], o) for o in outs[1:])
                    means.append(outs[0].view_as(p0))
                if outer is None:
                    for th, d in zip(theta, means):
                        th.add_(d)
                else:
                    for th, d in zip(theta, means):
                        th.grad = -d
                    outer.step()
                for r in range(n):
                    for (_, p), th in zip(named[r], theta):
                        p.copy_(th)
            t = engine.take_timings()
            sync_codec = (sum(t["encode_s"]) + sum(t["decode_s"])) / n
        codec.append(sync_codec / every)
        if step % eval_every == 0 or step >= limit or step == budget:
            roll = evaluate()
            stop = stop_reason(evals["metric"][-1], roll, target, step, limit, budget)
            if log:
                log(f"  {row} N={n} step {step}/{limit} ppl {evals['metric'][-1]:.3f} (rolling {roll:.3f})")
    w = comps[0].bytes_per_step()  # one sync's (each parameter's last call)
    return {"evals": evals, "steps_run": step, "stop_reason": stop, "every": every,
            "bytes": {"payload": w.payload / every, "side": w.side / every,
                      "side_collectives": w.side_collectives / every},
            "compute_s": statistics.median(compute), "codec_s": statistics.median(codec[every - 1::every] or codec),
            "ranks_agree": bool(agree), "steps_per_epoch": wl.steps_per_epoch}
