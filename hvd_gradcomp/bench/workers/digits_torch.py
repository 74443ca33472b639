"""Digits classifier (PyTorch + Horovod) with a compressor given as a spec string.

Run under Horovod, e.g.::

    horovodrun -np 2 --gloo python -m hvd_gradcomp.bench.workers.digits_torch --compression topkc:ratio=0.01

The model is an MLP 64-2048-2048-10 (4,349,962 parameters, see ``torch_workloads``); data
shards by rank, seeds are fixed (``--seed``). Each step is timed and split into:

- compute: forward, backward and the optimizer update, minus the compressor's own time;
- compress+decompress: the compressor's ``compress`` and ``decompress`` calls, timed by a
  proxy (:class:`hvd_gradcomp.bench.worker.TimedCompressor`) around the compressor object;
- communication: the rest of ``optimizer.synchronize()`` (waiting for the all-reduces that
  backward started) plus any synchronous side collective issued inside ``compress``.

``--accumulate K``: K micro-batches per optimizer step and all-reduce (a step of the records
is a micro-batch). ``--update-sync every=H``: no gradient all-reduce; each rank steps its own
optimizer and every H steps the ranks average the compressed parameter change
(:class:`UpdateSyncTrainer`, ``torch_backend.UpdateSync``). ``--recipe`` (``lm-comm``): the
training recipe and its learning-rate schedule (``torch_workloads.LMCommWorkload``).

With ``--out PATH`` rank 0 writes the records as JSON (the harness
``python -m hvd_gradcomp.bench tta`` runs this module and collects them).
"""
import argparse
import os
import sys

import torch
import horovod.torch as hvd

import torch_backend.reference_ops
from torch_backend import Compression

from .. import device as devices
from ..worker import TimedCompressor, WaitTimer, add_common_args
from . import torch_workloads


class HorovodTrainer:
    """One ``hvd.DistributedOptimizer`` step, timed (module docs).

    ``accumulate`` = K > 1: each call of :meth:`step` is one micro-batch; the gradients of K
    micro-batches are summed (each loss divided by K, so the step sees their mean) and Horovod
    all-reduces them once, on the K-th backward (``backward_passes_per_step=K``), before the
    one optimizer step. ``schedule``: an :class:`~.torch_workloads.LRSchedule` set before each
    optimizer step with the number of micro-batches so far (None: a constant rate)."""

    def __init__(self, workload, model, lr, spec, optimizer="", adam_log_every=0, optimizer_defaults=None,
                 device="cpu", accumulate=1, num_groups=0):
        self.workload, self.model = workload, model
        self.accumulate = int(accumulate)
        self.schedule = None
        self.device, self.clock = device, devices.clock(device)
        # The optimizer first: a row naming one this checkout lacks fails before any collective.
        opt = torch_workloads.build_optimizer(workload, model.parameters(), lr, optimizer, optimizer_defaults)
        # Blocking variants' side all-reduce (torch_backend.reference_ops._allreduce, which OPS
        # shares) counts as communication, not codec.
        self.compressor = TimedCompressor(Compression.from_spec(spec), torch_backend.reference_ops, "_allreduce",
                                          sync=devices.sync_fn(device))
        self.opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            compression=self.compressor, op=hvd.Average,
                                            backward_passes_per_step=self.accumulate,
                                            **({"num_groups": num_groups} if num_groups else {}))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        # Adam's per-tensor statistics, off the clock (adam_log_every = 0: none).
        self.probe = torch_workloads.AdamProbe(model.named_parameters(), self.opt, adam_log_every)
        self.steps = 0

    def step(self, x, y):
        # self.clock: perf_counter, after draining the GPU under --device cuda (device.clock).
        t0 = self.clock()
        self.steps += 1  # micro-batches (= optimizer steps without accumulation)
        if (self.steps - 1) % self.accumulate == 0:
            self.opt.zero_grad()
        loss = self.workload.loss(self.model, x, y)
        # Horovod's hooks compress each gradient and start its all-reduce (with accumulation:
        # on the K-th backward only)
        (loss / self.accumulate if self.accumulate > 1 else loss).backward()
        t1 = self.clock()
        if self.steps % self.accumulate:  # a micro-batch: no communication, no step
            return loss.detach(), t1 - t0, 0.0, 0.0
        self.opt.synchronize()  # wait for the all-reduces, decompress into p.grad
        if self.schedule is not None:
            self.schedule.set(self.steps)
        self.probe.before(self.steps)  # off the clock
        t2 = self.clock()
        with self.opt.skip_synchronize():
            self.opt.step()
        t3 = self.clock()
        self.probe.after(self.steps)
        comp_s, decomp_s, side_s = self.compressor.take()
        compute = (t1 - t0 - comp_s - side_s) + (t3 - t2)
        comm = (t2 - t1 - decomp_s) + side_s
        # wait = comm: the all-reduces were posted during backward (their posting is in the
        # backward's time), so all of comm is blocked on the link (synchronize, side collectives)
        return loss.detach(), compute, comp_s + decomp_s, comm, comm

    def allreduce_sum(self, values):
        out = hvd.allreduce(torch.tensor(values, dtype=torch.float64, device=self.device),
                            op=hvd.Sum, name="tta.eval")
        return out.tolist()

    def bytes_per_step(self):
        """Bytes per step (micro-batch) as of now; for ``auto``, also ``choices`` ({tensor: scheme spec}, what
        each ended on) and ``decisions`` (every decision: ``compressor.decisions()``)."""
        w = self.compressor.bytes_per_step()
        out = {"payload": w.payload, "side": w.side, "side_collectives": w.side_collectives}
        k = self.accumulate
        if k > 1:  # a step is a micro-batch: one all-reduce per k of them
            out = {"payload": w.payload // k, "side": w.side // k, "side_collectives": w.side_collectives / k,
                   "accumulate": k}
        chosen = {k: m["scheme"] for k, m in self.compressor.inner.metrics().items() if "scheme" in m}
        if chosen:
            out["choices"] = chosen
            out["decisions"] = self.compressor.inner.decisions()
        return out


class UpdateSyncTrainer:
    """One local optimizer step on this rank's gradient and, every ``every`` steps, the
    compressed update sync (:class:`torch_backend.UpdateSync`: no gradient all-reduce; the
    compressor sends each parameter's change since the last sync), timed: compute = forward,
    backward, the optimizer step; codec = the sync's encode and decode; communication = its
    all-reduces (``UpdateSync.timings``: posting, waiting, the count check); wait = the part of
    communication blocked on the link: the calls of ``hvd.synchronize`` (waiting for a posted
    all-reduce; with ``overlap``, for the round in flight) and of the blocking ``hvd.allreduce``
    (the count check) inside ``sync.step()`` (:class:`~hvd_gradcomp.bench.worker.WaitTimer`).
    ``sync_options``: UpdateSync's ``every``, ``outer_lr``, ``outer_momentum``, ``nesterov``,
    ``overlap``, ``fragments``, ``eager``. The Adam probe's ``update_rms`` here is the
    change over the step and its sync (the parameters after a sync are the synced ones)."""

    def __init__(self, workload, model, lr, spec, optimizer="", adam_log_every=0, optimizer_defaults=None,
                 device="cpu", sync_options=None):
        from torch_backend import UpdateSync
        self.workload, self.model = workload, model
        self.device, self.clock = device, devices.clock(device)
        self.schedule = None
        self.opt = torch_workloads.build_optimizer(workload, model.parameters(), lr, optimizer,
                                                   optimizer_defaults)
        self.compressor = Compression.from_spec(spec)
        self.sync = UpdateSync(self.opt, compression=self.compressor, model=model, backend="horovod",
                               **(sync_options or {}))  # broadcasts rank 0's parameters
        self.probe = torch_workloads.AdamProbe(model.named_parameters(), self.opt, adam_log_every)
        self.steps = 0
        self._times = self.sync.timings()
        # UpdateSync calls hvd.synchronize / hvd.allreduce through the module at call time
        self.waits = WaitTimer(hvd, ("synchronize", "allreduce"), self.clock)

    def step(self, x, y):
        t0 = self.clock()
        self.sync.zero_grad()
        loss = self.workload.loss(self.model, x, y)
        loss.backward()
        self.steps += 1
        if self.schedule is not None:
            self.schedule.set(self.steps)
        self.probe.before(self.steps)  # off the clock
        t1 = self.clock()
        with self.waits.watching():
            self.sync.step()  # the local step; every H (H / fragments with overlap) steps the sync
        t2 = self.clock()
        self.probe.after(self.steps)
        now = self.sync.timings()
        codec = (now["encode_s"] - self._times["encode_s"]) + (now["decode_s"] - self._times["decode_s"])
        comm = now["comm_s"] - self._times["comm_s"]
        self._times = now
        return loss.detach(), (t1 - t0) + (t2 - t1 - codec - comm), codec, comm, self.waits.take()

    def allreduce_sum(self, values):
        out = hvd.allreduce(torch.tensor(values, dtype=torch.float64, device=self.device),
                            op=hvd.Sum, name="tta.eval")
        return out.tolist()

    def bytes_per_step(self):
        """Bytes per optimizer step (a sync's bytes / every)."""
        w = self.sync.bytes_per_step()
        return {"payload": w.payload, "side": w.side, "side_collectives": w.side_collectives,
                "every": self.sync.every}


# --optimizer: the workload's own optimizer, or AdamW / FrozenVarianceAdamW (docs/optimizers.md).
# The workers take the general form, --optimizer NAME(k=v,...) (worker.parse_optimizer, with
# "default" and "frozen_adamw" as aliases), and --freeze-step/--weight-decay as the defaults of
# adamw/frozen-adamw options a row does not give (optimizer_defaults).
def add_optimizer_args(parser, with_name=True):
    """``--optimizer`` (only with ``with_name``: the choices default/adamw/frozen_adamw),
    ``--freeze-step``, ``--weight-decay`` (only for adamw/frozen_adamw)."""
    g = parser.add_argument_group("optimizer")
    if with_name:
        g.add_argument("--optimizer", default="default", choices=("default", "adamw", "frozen_adamw"),
                       help="default: the workload's own (digits: SGD momentum 0.9; lm: Adam); adamw: "
                            "torch.optim.AdamW; frozen_adamw: torch_backend.FrozenVarianceAdamW")
    g.add_argument("--freeze-step", type=int, default=100,
                   help="frozen_adamw: steps before the second moment freezes (default 100)")
    g.add_argument("--weight-decay", type=float, default=0.0,
                   help="adamw/frozen_adamw: decoupled weight decay (default 0: Adam's update)")


def optimizer_defaults(args):
    """``{optimizer name: default options}`` from ``--weight-decay``/``--freeze-step`` (for a
    row's ``adamw``/``frozen-adamw`` options it does not give; see ``build_optimizer``)."""
    return {"adamw": {"weight_decay": args.weight_decay},
            "frozen-adamw": {"weight_decay": args.weight_decay, "freeze_step": args.freeze_step}}


def optimizer_factory(args):
    """None (the workload's optimizer) or ``(params, lr) -> optimizer`` for ``--optimizer``."""
    if args.optimizer == "adamw":
        return lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=args.weight_decay)
    if args.optimizer == "frozen_adamw":
        from torch_backend import FrozenVarianceAdamW
        return lambda params, lr: FrozenVarianceAdamW(params, lr=lr, weight_decay=args.weight_decay,
                                                      freeze_step=args.freeze_step)
    return None


def main(argv=None, workload="digits"):
    cls = torch_workloads.WORKLOADS[workload]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if workload == "digits"
                                     else f"{workload} workload (PyTorch + Horovod)")
    add_common_args(parser, higher_is_better=cls.higher_is_better, **cls.defaults)
    if workload == "digits":
        parser.add_argument("--hidden", type=int, default=2048, help="MLP width (default 2048)")
    parser.add_argument("--adam-log-every", type=int, default=getattr(cls, "adam_log_every", 0),
                        help="log Adam's per-tensor update RMS and second moment every this many "
                             "steps (over the 10 steps before; 0: off)")
    add_optimizer_args(parser, with_name=False)  # --optimizer is a common flag (worker.py)
    g = parser.add_argument_group("instead of compressing each step's gradient")
    g.add_argument("--accumulate", type=int, default=1,
                   help="micro-batches (of --batch-size) per optimizer step and all-reduce (default 1)")
    g.add_argument("--update-sync", default=None, metavar="OPTIONS",
                   help="compressed update sync (torch_backend.UpdateSync) instead of the gradient "
                        "all-reduce, e.g. 'every=8' or 'every=8,overlap=true,fragments=2' (options: "
                        "every, outer_lr, outer_momentum, nesterov, overlap, fragments, eager); the "
                        "--compression spec compresses the parameter change")
    parser.add_argument("--num-groups", type=int, default=0,
                   help="Horovod's num_groups: the gradients all-reduced in this many groups, each "
                        "compressed as one bucket (one codec call per group and route; "
                        "hvd_gradcomp/grouped.py); 0 (default): none, one codec call per tensor")
    torch_workloads.add_recipe_args(parser, cls)
    devices.add_device_arg(parser)
    args = parser.parse_args(argv)
    if args.accumulate < 1:
        parser.error(f"--accumulate must be >= 1, got {args.accumulate}")
    if args.num_groups < 0:
        parser.error(f"--num-groups must be >= 0, got {args.num_groups}")
    sync_options = None
    if args.update_sync is not None:
        from ..tta import parse_update_sync
        try:
            sync_options = parse_update_sync(args.update_sync)
        except ValueError as e:
            parser.error(str(e))
        if args.accumulate > 1:
            parser.error("--accumulate and --update-sync together are not supported")
        if args.num_groups:
            parser.error("--num-groups and --update-sync together are not supported (update sync "
                         "all-reduces the parameter changes itself)")
    devices.require_device(parser, args.device)
    hvd.init()
    if args.device != "cpu":
        devices.require_device(parser, args.device, horovod=hvd)
    device = devices.rank_device(args.device, hvd.rank())
    torch.manual_seed(args.seed)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    extra = {"hidden": args.hidden} if workload == "digits" else {}
    wl = devices.place_workload(cls(hvd.rank(), hvd.size(), args.seed, args.batch_size, **extra), device)
    if getattr(args, "recipe", None):
        wl.recipe = args.recipe
    model = wl.model().to(device)
    try:
        if sync_options is not None:
            trainer = UpdateSyncTrainer(wl, model, args.lr, args.compression, args.optimizer, args.adam_log_every,
                                        optimizer_defaults(args), device, sync_options)
        else:
            trainer = HorovodTrainer(wl, model, args.lr, args.compression, args.optimizer, args.adam_log_every,
                                     optimizer_defaults(args), device, args.accumulate, args.num_groups)
    except (ValueError, TypeError) as e:  # a bad or missing optimizer or spec: the same message on every rank
        print(f"{workload} worker: {e}", file=sys.stderr, flush=True)
        hvd.shutdown()
        return 2
    # The optimizer as built (a row's --optimizer may override --lr, which meta records too):
    # its first parameter group's options (Horovod's wrapper re-initialises ``defaults``).
    built = {k: list(v) if isinstance(v, tuple) else v for k, v in trainer.opt.param_groups[0].items()
             if k != "params" and isinstance(v, (bool, int, float, tuple))}
    trainer.schedule = torch_workloads.make_schedule(wl, trainer.opt, args)  # the recipe's
    meta = {"framework": "torch", "system": "horovod", "label": args.compression, "device": str(device),
            "accumulate": args.accumulate, "update_sync": args.update_sync,
            "num_groups": args.num_groups,
            "recipe": getattr(args, "recipe", None),
            "schedule_steps": None if trainer.schedule is None else trainer.schedule.total,
            "optimizer_class": type(trainer.opt).__name__,  # Horovod's wrapper keeps the name
            "optimizer_options": built}
    torch_workloads.train(wl, model, trainer, args, hvd.rank(), hvd.size(), meta,
                          trainer.bytes_per_step)
    if hasattr(trainer.compressor, "close"):
        trainer.compressor.close()
    if isinstance(trainer, UpdateSyncTrainer):
        trainer.waits.close()
        trainer.sync.synchronize()  # off the records: drains an overlapped round in flight, every rank alike
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
