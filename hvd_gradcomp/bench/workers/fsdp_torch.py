"""The PyTorch LM workloads under FSDP2 as HSDP (``fully_shard`` on a ``(replicate, shard)``
mesh), FSDP's collectives native or compressed (:mod:`torch_backend.fsdp`). Gloo on the CPU,
NCCL with ``--device cuda`` (one GPU per rank; untested on GPUs here). Launch with torchrun-style variables (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``; the harness sets them), e.g.::

    torchrun --nproc_per_node 4 -m hvd_gradcomp.bench.workers.fsdp_torch --workload lm-comm \\
        --mesh 2x2 --compression thc

**The model.** Every transformer layer (``model.blocks.layers[i]``) is ``fully_shard``-ed on
the 2-D mesh, then the root (embedding, positions, final norm, head): one FSDP parameter group
per layer and one for the rest. The mesh is ``init_device_mesh(device, (R, S),
mesh_dim_names=("replicate", "shard"))``, so ranks ``r*S .. r*S + S-1`` are replica ``r``'s
shard group (the harness puts them on one emulated host: :mod:`..netem`, ``ranks_per_host``)
and ranks ``s, S+s, ...`` hold shard ``s`` on every replica. Every rank builds the same
initial model from ``--seed`` (FSDP shards it; nothing is broadcast).

**Reduction.** Every row reduces in float16 (``MixedPrecisionPolicy(reduce_dtype=torch.float16)``;
parameters and compute stay float32), except ``--compression none``:

- ``--compression fp16``: FP16-FSDP, the baseline: FSDP's own reduce-scatter within the shard
  group and its own all-reduce across replicas, both in float16, no hook of ours (what a user
  gets from the mixed-precision policy alone);
- ``--compression none`` (or ``fp32``): FSDP's own collectives in float32 (no policy);
- any other spec: FSDP's own float16 reduce-scatter, then this project's compressor on the
  all-reduce across replicas (:func:`torch_backend.fsdp.install`, which turns FSDP's own off).

``--reduce-scatter SPEC`` (S >= 2): the reduce-scatter within the shard group compressed as
well, by a compressor of its own (:func:`torch_backend.fsdp.install_reduce_scatter`: none,
fp16, bf16, thc, signsgd).

**Time split** (FSDP overlaps its collectives with backward; the parts cannot be read off one
timer):

- compute: forward + backward of an unsharded copy of the model on the same batch, on this
  rank, with no communication (every ``--eval-every`` steps, off the clock; the median of the
  last 5; at most the step's own forward + backward less its codec time, so the three parts
  always sum to the step's measured time), plus the optimizer step;
- compress+decompress: the compressors' codec calls inside FSDP's hooks (``plan_bucket``,
  ``encode_unit``, ``decode``, ``decode_scattered``), timed by :func:`timed_compressor`;
- communication: the rest of forward + backward (FSDP's all-gathers, its reduce-scatter and
  the all-reduce across replicas, native or the hook's).

**Bytes** (``bytes_per_step``): ``payload``/``side`` are what this rank hands to the all-reduce
across replicas per step (its shards: the slow link), the numbers every row's ``bytes/step``
compares; ``reduce_scatter`` is this rank's input to the reduce-scatter within the shard group
(the fast link), apart. Native collectives: the padded shard's (or, reduce-scatter, the padded
full gradient's) coordinates times the reduce dtype's size.
"""
import argparse
import math
import os
import statistics
import sys

import torch
import torch.distributed as dist

from .. import device as devices
from ..tta_hooks import fsdp_compression, fsdp_label, parse_fsdp_mesh
from ..worker import add_common_args
from . import torch_workloads

__all__ = ["native_spec", "timed_compressor", "FSDPTrainer", "main", "WORKLOADS"]

WORKLOADS = ("lm", "lm-comm")  # the transformer workloads (torch_workloads.ByteTransformer)
# --compression values that mean FSDP's own collectives -> their reduce dtype
NATIVE = {"fp16": torch.float16, "none": torch.float32, "fp32": torch.float32}


def native_spec(spec):
    """The reduce dtype of FSDP's own collectives for ``spec`` (``fp16``: float16, ``none``/
    ``fp32``: float32), or None for a spec of this project's compressors."""
    return NATIVE.get(spec.strip())


def timed_compressor(comp, clock):
    """Time ``comp``'s codec calls from FSDP's hooks: its codec's class becomes a subclass (no
    new state, the same slots) whose ``plan_bucket``, ``encode_unit``, ``decode`` and
    ``decode_scattered`` add their duration (``clock()`` seconds, e.g. :func:`..device.clock`,
    which drains the GPU first) to the class's ``codec_s``. Returns the subclass; its
    ``take()`` reads and resets ``codec_s``."""
    base = type(comp.codec)

    def timed(name):
        inner = getattr(base, name)

        def call(self, *args, **kwargs):
            t0 = clock()
            try:
                return inner(self, *args, **kwargs)
            finally:
                Timed.codec_s += clock() - t0
        call.__name__ = name
        return call

    Timed = type(f"Timed{base.__name__}", (base,), {
        "__slots__": (), "codec_s": 0.0,
        **{n: timed(n) for n in ("plan_bucket", "encode_unit", "decode", "decode_scattered")}})

    def take():
        out, Timed.codec_s = Timed.codec_s, 0.0
        return out
    Timed.take = staticmethod(take)
    comp.codec.__class__ = Timed
    return Timed


def _shard_numel(model, shards):
    """Coordinates of this rank's padded shards: per parameter ``ceil(d0 / S) x (numel / d0)``
    (FSDP2 pads dim 0 to a multiple of S), summed."""
    total = 0
    for p in model.parameters():
        shape = tuple(p.shape)  # a DTensor's global shape
        rest = math.prod(shape[1:])
        total += -(-shape[0] // shards) * rest if shape else 1
    return total


class FSDPTrainer:
    """One FSDP step, timed (module docs). ``schedule``: the recipe's learning-rate schedule
    (:func:`.torch_workloads.make_schedule`), set before each optimizer step."""

    def __init__(self, workload, model, local, lr, mesh, spec, rs_spec, calib_every, device="cpu",
                 optimizer="", overlap=False, delay=0):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch_backend import Compression
        from torch_backend.fsdp import install, install_reduce_scatter
        self.workload, self.local = workload, local
        self.device, self.clock = device, devices.clock(device)
        self.replicas, self.shards = mesh.size(0), mesh.size(1)
        self.native = native_spec(spec)
        reduce_dtype = torch.float32 if self.native is torch.float32 else torch.float16
        self.reduce_dtype = reduce_dtype
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype) if reduce_dtype != torch.float32 else None
        kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy is not None else {})}
        for layer in model.blocks.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        self.model = model
        self.timers = []
        self.compressor = self.scatter = None
        if self.native is None:
            self.compressor = install(model, Compression.from_spec(spec), overlap=overlap, delay=delay)
            self.timers.append(timed_compressor(self.compressor, self.clock))
        if rs_spec:
            self.scatter = install_reduce_scatter(model, Compression.from_spec(rs_spec))
            self.timers.append(timed_compressor(self.scatter, self.clock))
        self.opt = torch_workloads.build_optimizer(workload, model.parameters(), lr, optimizer)
        self.schedule = None
        self.calib, self.calib_every, self.steps = [], int(calib_every), 0

    def _calibrate(self, x, y):
        """Forward + backward of the unsharded copy on this batch (no communication), seconds;
        the first call runs it once untimed first (allocation, first-call costs)."""
        if not self.calib:
            self.workload.loss(self.local, x, y).backward()
        self.local.zero_grad(set_to_none=True)
        t0 = self.clock()
        self.workload.loss(self.local, x, y).backward()
        self.calib.append(self.clock() - t0)
        self.local.zero_grad(set_to_none=True)

    def step(self, x, y):
        if self.steps % self.calib_every == 0:
            self._calibrate(x, y)  # off the clock
        self.steps += 1
        for t in self.timers:
            t.take()
        t0 = self.clock()
        self.opt.zero_grad()
        loss = self.workload.loss(self.model, x, y)
        loss.backward()  # FSDP reduce-scatters, then all-reduces across replicas (or our hook)
        t1 = self.clock()
        if self.schedule is not None:
            self.schedule.set(self.steps)
        self.opt.step()
        t2 = self.clock()
        codec = sum(t.take() for t in self.timers)
        # the calibrated compute, at most what forward + backward took: the parts sum to the step
        fb = min(statistics.median(self.calib[-5:]), max(0.0, (t1 - t0) - codec))
        return loss.detach(), fb + (t2 - t1), codec, (t1 - t0) - fb - codec

    def allreduce_sum(self, values):
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def bytes_per_step(self):
        """``{"payload", "side", "side_collectives"}``: this rank's bytes to the all-reduce
        across replicas per step; ``"reduce_scatter"``: its input to the reduce-scatter within
        the shard group (0 with one shard); ``"mesh"``: ``[R, S]`` (module docs)."""
        width = torch.finfo(self.reduce_dtype).bits // 8
        shard = _shard_numel(self.model, self.shards)
        if self.compressor is not None:
            b = self.compressor.bytes_per_step()
            out = {"payload": b.payload, "side": b.side, "side_collectives": b.side_collectives}
        else:
            out = {"payload": width * shard, "side": 0, "side_collectives": 0}
        if self.scatter is not None:
            b = self.scatter.bytes_per_step()
            out["reduce_scatter"] = b.payload + b.side
        else:
            out["reduce_scatter"] = width * shard * self.shards if self.shards > 1 else 0
        out["mesh"] = [self.replicas, self.shards]
        return out


def main(argv=None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workload", choices=WORKLOADS, default="lm-comm")
    known, _ = pre.parse_known_args(argv)
    cls = torch_workloads.WORKLOADS[known.workload]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[pre])
    add_common_args(parser, higher_is_better=cls.higher_is_better, **cls.defaults)
    parser.add_argument("--mesh", default="", help="RxS: R replicas of S shards (default 2 x world/2)")
    parser.add_argument("--overlap", action="store_true",
                        help="install our hook with overlap=True (torch_backend.fsdp.install)")
    parser.add_argument("--delay", type=int, default=0,
                        help="install our hook with delay=D (1: step t's mean applied at step t + 1; "
                             "torch_backend.fsdp.install); 0: blocking")
    parser.add_argument("--reduce-scatter", default="",
                        help="compress the reduce-scatter within the shard group too: none, fp16, "
                             "bf16, thc, signsgd (S >= 2)")
    devices.add_device_arg(parser)
    torch_workloads.add_recipe_args(parser, cls)
    args = parser.parse_args(argv)
    devices.require_device(parser, args.device)
    spec, rs_spec = args.compression.strip(), args.reduce_scatter.strip() or None
    args.compression = fsdp_compression(spec, rs_spec, args.overlap, args.delay)
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    rank, size = dist.get_rank(), dist.get_world_size()
    try:
        replicas, shards = parse_fsdp_mesh(args.mesh, size)
        if args.overlap and native_spec(spec) is not None:
            raise ValueError(f"--overlap installs our hook with overlap=True; {spec!r} is FSDP's own "
                             f"all-reduce")
        if args.delay and native_spec(spec) is not None:
            raise ValueError(f"--delay installs our hook with delay={args.delay}; {spec!r} is FSDP's own "
                             f"all-reduce")
        if rs_spec and shards < 2:
            raise ValueError(f"--reduce-scatter {rs_spec}: the mesh {replicas}x{shards} has one shard per "
                             f"replica, so FSDP reduce-scatters nothing")
    except ValueError as e:  # the same on every rank
        print(f"fsdp worker: {e}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return 2
    device = devices.rank_device(args.device, rank)
    torch.manual_seed(args.seed)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    wl = devices.place_workload(cls(rank, size, args.seed, args.batch_size), device)
    if getattr(args, "recipe", None):
        wl.recipe = args.recipe
    model = wl.model().to(device)  # the same initial parameters on every rank (the seed)
    local = wl.model().to(device)  # the compute calibration's unsharded copy
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(torch.device(device).type, (replicas, shards), mesh_dim_names=("replicate", "shard"))
    try:
        trainer = FSDPTrainer(wl, model, local, args.lr, mesh, spec, rs_spec, args.eval_every, device,
                              args.optimizer, overlap=args.overlap, delay=args.delay)
    except (ValueError, TypeError) as e:  # a spec install refuses: the same message on every rank
        print(f"fsdp worker: {e}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return 2
    trainer.schedule = torch_workloads.make_schedule(wl, trainer.opt, args)
    meta = {"framework": "torch", "system": "fsdp", "label": fsdp_label("none" if spec == "fp32" else spec, rs_spec, args.overlap,
                                                                     args.delay),
            "device": str(device),
            "mesh": f"{replicas}x{shards}", "replicas": replicas, "shards": shards,
            "all_reduce": f"native {trainer.reduce_dtype}".replace("torch.", "") if trainer.native is not None else spec,
            "reduce_scatter": rs_spec or f"native {trainer.reduce_dtype}".replace("torch.", ""),
            "reduce_dtype": str(trainer.reduce_dtype).replace("torch.", ""),
            "recipe": getattr(args, "recipe", None),
            "schedule_steps": None if trainer.schedule is None else trainer.schedule.total,
            "optimizer_class": type(trainer.opt).__name__}
    torch_workloads.train(wl, trainer.model, trainer, args, rank, size, meta, trainer.bytes_per_step)
    if args.delay:  # the last step's all-reduces, in flight: waited for (a peer's failure raises here)
        from torch_backend.fsdp_delayed import delayed_state
        delayed_state(trainer.model).drain()
    dist.barrier()  # leave together: a rank tearing down Gloo early can abort its peer
    # Then leave without Gloo's teardown: destroying a 2-D mesh's subgroups aborted a rank now
    # and then after every result was written and the barrier passed ("terminate called
    # without an active exception", exit -6: once in a dozen smoke sweeps of the overlap row).
    # Rank 0's JSON is already in place (written to a temporary file and renamed).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
