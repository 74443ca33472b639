"""The same PyTorch workloads under ``torch.distributed`` DDP (Gloo; NCCL with ``--device cuda``) with its built-in hooks.

What a PyTorch user would pick instead of Horovod + hvd-gradcomp: DDP's own communication
hooks. Launch with torchrun-style variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``; the harness sets them), e.g.::

    torchrun --nproc_per_node 2 -m hvd_gradcomp.bench.workers.ddp_torch --workload digits --hook fp16

``--hook``: ``none`` (DDP's plain fp32 all-reduce), ``fp16`` (``fp16_compress_hook``),
``powersgd:rank=R`` (``powerSGD_hook`` with ``PowerSGDState(matrix_approximation_rank=R,
start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)``; 2 is the smallest warm-up
DDP accepts with error feedback), or ``ours:<spec>``: this project's compressor ``<spec>``
(``ours:thc``, ``ours:powersgd:rank=4``) as a DDP hook (:mod:`torch_backend.ddp`), the row
"<spec> on DDP".

Time split (DDP overlaps its all-reduces with backward and waits at the end of backward, so
the parts cannot be read off one timer):

- compute: forward + backward measured without communication (``model.no_sync()`` on the
  same batch, every ``--eval-every`` steps, off the clock; the median is used) plus the
  optimizer update;
- compress+decompress: time spent inside the hook call itself (compression and launching the
  all-reduce; PowerSGD's later steps run in future callbacks and count as communication, so
  this is a lower bound);
- communication: the rest of the step.

Buckets: one, of up to 64 MiB (see ``DDPTrainer``).
"""
import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import device as devices
from ..worker import add_common_args
from . import torch_workloads


def parse_hook(spec):
    """``"none"``, ``"fp16"``, ``"powersgd:rank=R"`` -> (name, rank); ``"ours:<spec>"`` ->
    ("ours", canonical spec)."""
    name, _, rest = spec.partition(":")
    if name == "ours":
        from hvd_gradcomp.routing import Routing
        return "ours", Routing.from_spec(rest).spec()
    if name in ("none", "fp32") and not rest:
        return "none", None
    if name == "fp16" and not rest:
        return "fp16", None
    if name == "powersgd":
        opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        unknown = set(opts) - {"rank"}
        if unknown:
            raise ValueError(f"ddp hook powersgd: unknown option(s) {sorted(unknown)}; expected rank")
        return "powersgd", int(opts.get("rank", 1))
    raise ValueError(f"ddp hook must be none, fp16, powersgd:rank=R or ours:<spec>, got {spec!r}")


def wire_bytes(model, hook, rank, min_compression_rate=2):
    """Bytes per rank per step handed to DDP's all-reduces (PowerSGD after its warm-up)."""
    payload = side = 0
    for p in model.parameters():
        n = p.numel()
        if hook == "none":
            payload += 4 * n
        elif hook == "fp16":
            payload += 2 * n
        else:  # PowerSGD views each tensor as rows x rest; 1-D tensors go uncompressed
            rows = p.shape[0] if p.dim() > 1 else 1
            cols = n // rows
            if p.dim() > 1 and (rows + cols) * rank * min_compression_rate < rows * cols:
                side += 4 * rows * rank  # P
                payload += 4 * cols * rank  # Q
            else:
                payload += 4 * n
    return {"payload": payload, "side": side, "side_collectives": None}


def delayed_hook(ddp_model, compressor, delay):
    """``(state, hook)`` of our hook with delayed gradient sync (``delay`` >= 1 steps), for
    :class:`DDPTrainer` to time: ``torch_backend.ddp.make_comm_hook(..., delay=D)`` when it
    takes ``delay``; else, when only ``register_comm_hook`` does, that registers it itself and
    ``(None, None)`` is returned (the hook then untimed: its time counts as communication).

    Raises:
        ValueError: neither takes ``delay`` (this checkout has no delayed hook).
    """
    import inspect
    from torch_backend import ddp as ours
    if "delay" in inspect.signature(ours.make_comm_hook).parameters:
        return ours.make_comm_hook(ddp_model, compressor, delay=delay)
    if "delay" in inspect.signature(ours.register_comm_hook).parameters:
        ours.register_comm_hook(ddp_model, compressor, delay=delay)
        return None, None
    raise ValueError("--delay: this checkout's torch_backend.ddp.register_comm_hook has no delay= option")


ONE_BUCKET_MB = 64.0  # DDP's bucket_cap_mb by default: every workload's whole gradient in one bucket


class DDPTrainer:
    def __init__(self, workload, model, lr, hook, rank, seed, calib_every, device="cpu", optimizer="", delay=0,
                 bucket_cap_mb=ONE_BUCKET_MB):
        self.workload = workload
        self.device, self.clock = device, devices.clock(device)
        # By default one bucket of up to 64 MiB (an explicit cap also sizes DDP's first bucket):
        # the whole gradient of every workload (17.4 MB at most) in one all-reduce, as Horovod's
        # default fusion buffer (128 MiB in 0.28.1) holds it. With DDP's default small first
        # bucket, powerSGD_hook on Gloo hung here: each bucket's future callback issues a nested
        # all-reduce from a Gloo thread and waits for it, and with two buckets the ranks could
        # post those in different orders. A smaller cap (--bucket-cap-mb, our hooks only) posts
        # buckets during backward, overlapping their all-reduces with the rest of it.
        self.model = DDP(model, bucket_cap_mb=bucket_cap_mb,  # broadcasts rank 0's parameters
                         device_ids=None if torch.device(device).type == "cpu" else [torch.device(device).index])
        self.opt = torch_workloads.build_optimizer(workload, self.model.parameters(), lr, optimizer)
        self.schedule = None  # the recipe's learning-rate schedule (torch_workloads.make_schedule)
        self.hook_s = 0.0
        self.calib, self.calib_every, self.steps = [], calib_every, 0
        self.compressor = None
        if hook == "ours":
            from torch_backend import Compression
            from torch_backend.ddp import make_comm_hook
            self.compressor = Compression.from_spec(rank)
            if delay:
                state, fn = delayed_hook(self.model, self.compressor, delay)
            else:
                state, fn = make_comm_hook(self.model, self.compressor)
        elif hook == "fp16":
            state, fn = None, default_hooks.fp16_compress_hook
        elif hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                                start_powerSGD_iter=2, use_error_feedback=True,
                                                warm_start=True, random_seed=seed)
            fn = powerSGD_hook.powerSGD_hook
        else:
            state = fn = None
        if fn is not None:
            def timed(state, bucket):
                t0 = self.clock()
                try:
                    return fn(state, bucket)
                finally:
                    self.hook_s += self.clock() - t0
            self.model.register_comm_hook(state, timed)

    def _calibrate(self, x, y):
        self.opt.zero_grad()
        t0 = self.clock()
        with self.model.no_sync():
            self.workload.loss(self.model, x, y).backward()
        self.calib.append(self.clock() - t0)
        self.opt.zero_grad()

    def step(self, x, y):
        if self.steps % self.calib_every == 0:
            self._calibrate(x, y)  # off the clock
        self.steps += 1
        self.hook_s = 0.0
        t0 = self.clock()
        self.opt.zero_grad()
        loss = self.workload.loss(self.model, x, y)
        loss.backward()  # DDP all-reduces buckets during backward and waits at its end
        t1 = self.clock()
        if self.schedule is not None:
            self.schedule.set(self.steps)
        self.opt.step()
        t2 = self.clock()
        fb = statistics.median(self.calib[-5:])
        codec = self.hook_s
        comm = (t1 - t0) - fb - codec
        # wait = comm: the rest of the step after compute and the hook calls is DDP waiting
        # for its all-reduces at the end of backward (a wait inside the hook call, e.g. a
        # delayed hook's wait for the previous step's round, counts as codec: a bound)
        return loss.detach(), fb + (t2 - t1), codec, comm, comm

    def allreduce_sum(self, values):
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()


def main(argv=None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workload", choices=sorted(torch_workloads.WORKLOADS), default="digits")
    known, _ = pre.parse_known_args(argv)
    cls = torch_workloads.WORKLOADS[known.workload]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[pre])
    add_common_args(parser, higher_is_better=cls.higher_is_better, **cls.defaults)
    parser.add_argument("--hook", default="fp16", help="none, fp16, powersgd:rank=R or ours:<spec>")
    parser.add_argument("--delay", type=int, default=0,
                        help="ours:<spec> only: delayed gradient sync, step t's mean applied at step "
                             "t + D (torch_backend.ddp.register_comm_hook(..., delay=D)); 0: none")
    parser.add_argument("--bucket-cap-mb", type=float, default=ONE_BUCKET_MB,
                        help="DDP's bucket_cap_mb (default 64: the whole gradient in one bucket); "
                             "smaller: buckets posted during backward (ours:<spec> and none only)")
    if known.workload == "digits":
        parser.add_argument("--hidden", type=int, default=2048)
    devices.add_device_arg(parser)
    torch_workloads.add_recipe_args(parser, cls)
    args = parser.parse_args(argv)
    devices.require_device(parser, args.device)
    hook, hook_rank = parse_hook(args.hook)
    if args.delay < 0 or (args.delay and hook != "ours"):
        parser.error(f"--delay must be >= 0 and is for --hook ours:<spec> only, got {args.delay} with {args.hook}")
    if args.bucket_cap_mb <= 0 or (args.bucket_cap_mb != ONE_BUCKET_MB and hook not in ("ours", "none")):
        parser.error(f"--bucket-cap-mb must be > 0 and is for --hook ours:<spec> or none only (DDP's "
                     f"powerSGD_hook hangs on Gloo with several buckets), got {args.bucket_cap_mb:g} with {args.hook}")
    args.compression = f"ddp:{args.hook}"
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    rank, size = dist.get_rank(), dist.get_world_size()
    device = devices.rank_device(args.device, rank)
    torch.manual_seed(args.seed)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    extra = {"hidden": args.hidden} if known.workload == "digits" else {}
    wl = devices.place_workload(cls(rank, size, args.seed, args.batch_size, **extra), device)
    if getattr(args, "recipe", None):
        wl.recipe = args.recipe
    model = wl.model().to(device)
    trainer = DDPTrainer(wl, model, args.lr, hook, hook_rank, args.seed, args.eval_every, device, args.optimizer,
                         args.delay, args.bucket_cap_mb)
    trainer.schedule = torch_workloads.make_schedule(wl, trainer.opt, args)
    label = {"none": "DDP fp32", "fp16": "DDP fp16_compress_hook",
             "powersgd": f"DDP powerSGD_hook rank={hook_rank}", "ours": f"{hook_rank} on DDP"}[hook]
    if args.delay:
        label = f"{hook_rank} with delay({args.delay}) on DDP"
    if args.bucket_cap_mb != ONE_BUCKET_MB:
        label += f" (buckets of {args.bucket_cap_mb:g} MB)"
    meta = {"framework": "torch", "system": "ddp", "label": label, "hook": args.hook, "delay": args.delay,
            "bucket_cap_mb": args.bucket_cap_mb,
            "ddp_start_powerSGD_iter": 2 if hook == "powersgd" else None, "device": str(device)}
    if hook == "ours":
        def wire():
            b = trainer.compressor.bytes_per_step()
            return {"payload": b.payload, "side": b.side, "side_collectives": b.side_collectives}
    else:
        def wire():
            return wire_bytes(model, hook, hook_rank or 1)
    torch_workloads.train(wl, trainer.model, trainer, args, rank, size, meta, wire)
    dist.barrier()  # leave together: a rank tearing down Gloo early can abort its peer
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
