"""(Helper, not a test.) Kernel launches per DDP step, counted (not timed) on CPU tensors.

What a GPU would be given to run by the DDP hook (:func:`torch_backend.ddp.hook`), counted on
one thread with the Triton forms in Triton's interpreter (``TRITON_INTERPRET=1``,
``HVD_GRADCOMP_KERNELS=triton``):

- **Triton launches**: calls of a Triton kernel (``kernel[grid](...)``), per kernel name;
- **torch launches**: ATen operations that would launch a kernel on a GPU, seen by a
  ``TorchDispatchMode``: every operation but views (``OpOverload.is_view``), allocations
  (``empty``), ``detach``/``alias``/``lift_fresh`` and metadata reads.

The buckets are model A's as DDP forms them (:func:`hvd_gradcomp.bench.codec.model_a`, the
default ``bucket_cap_mb``, after DDP's rebuild at the first step), recorded by a one-process
Gloo DDP run; the hook then runs on each bucket through a duck-typed bucket and an engine whose
all-reduce (world size 1) completes at once, so every callback runs on this thread.

``python -m tests.core.launch_counts SPEC [STEPS]`` prints one JSON line: for the last step the
Triton launches by kernel, the torch launches by operation, and the totals, counted with the
GPU's paths where the CPU takes its own (:func:`gpu_paths`).
"""
import collections
import contextlib
import datetime
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Counter", "counting", "gpu_paths", "model_a_buckets", "hook_steps"]

# Operations that launch nothing on a GPU (allocations, aliases) besides views.
_FREE = {"empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh", "_local_scalar_dense",
         "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
         "record_stream"}


class Counter(TorchDispatchMode):
    """Counts ATen operations that would launch a GPU kernel (module docstring)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.inside = 0  # > 0 while a Triton launch runs (the interpreter's own copies: not counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and not func.is_view and name not in _FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting():
    """``(triton Counter by kernel name, torch Counter)`` filled while the block runs: every
    Triton launch (interpreted or compiled) and every launching ATen operation on this thread."""
    from triton.runtime import jit
    launches = collections.Counter()
    counter = Counter()
    patched = []
    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - Triton without an interpreter
        pass
    for cls in classes:
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            fn = getattr(self, "fn", None)
            launches[getattr(fn, "__name__", repr(self))] += 1
            counter.inside += 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                counter.inside -= 1
        cls.run = run
        patched.append((cls, original))
    try:
        with counter:
            yield launches, counter.ops
    finally:
        for cls, original in patched:
            cls.run = original


class _Bucket:
    """The parts of DDP's ``GradBucket`` that the hook reads."""

    def __init__(self, index, buffer, params, offsets):
        self._index, self._buffer, self._params, self._offsets = index, buffer, params, offsets

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def gradients(self):
        return [self._buffer[o:o + p.numel()].view(p.shape) for p, o in zip(self._params, self._offsets)]


class _Engine:
    """World size 1; ``post`` returns a completed future (its ``then`` runs at once, here)."""

    def world(self):
        return 1, 0

    def gather(self, obj):
        return [obj]

    def allreduce(self, x, average):
        return x.clone()

    def post(self, flat):
        fut = torch.futures.Future()
        fut.set_result([flat])
        return fut

    def wait(self, work):
        return work.value()[0]


def model_a_buckets():
    """Model A's module and its DDP buckets after the rebuild: ``(module, [[parameter, ...]
    per bucket, in bucket order]])``, from a one-process Gloo run (initialised here when no
    process group is)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from hvd_gradcomp.bench.codec import model_a
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
        # one rank only; a bounded timeout besides the caller's (test_triton_launches.py runs this
        # module in its own session under a timeout that kills the whole process group)
        dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    module, loss = model_a()
    ddp = DDP(module)
    seen = {}

    def record(state, bucket):
        seen[bucket.index()] = list(bucket.parameters())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    ddp.register_comm_hook(None, record)
    for _ in range(2):  # DDP rebuilds its buckets after the first step
        seen.clear()
        module.zero_grad(set_to_none=True)
        loss(ddp).backward()
    return module, [seen[i] for i in sorted(seen)]


@contextlib.contextmanager
def gpu_paths():
    """The host paths a GPU does not take, replaced by the GPU's while the block runs:
    ``ops.select`` blends both branches (``torch.where`` per tensor) instead of reading its
    predicate, and a bucket's non-contiguous group is gathered and scattered by
    ``index_select``/``index_copy_`` instead of the CPU's ``memcpy`` runs."""
    from torch_backend.kernels import runs
    from torch_backend.ops import OPS
    from torch_backend.reference_ops import where_tree
    saved = OPS.select, runs._lib, runs._why
    object.__setattr__(OPS, "select", lambda pred, t, f: where_tree(pred, t(), f()))
    runs._lib, runs._why = None, "counting a GPU's launches"
    try:
        yield
    finally:
        object.__setattr__(OPS, "select", saved[0])
        runs._lib, runs._why = saved[1], saved[2]


def hook_steps(spec, module, buckets, steps=2, per_tensor=False, seed=0):
    """Run the DDP hook of ``spec`` on ``buckets`` (lists of ``module``'s parameters) for
    ``steps`` steps, the last one counted; returns ``(triton Counter, torch Counter)``."""
    from torch_backend import Compression
    from torch_backend.ddp import HookState, hook
    comp = Compression.from_spec(spec)
    names = {p: n for n, p in module.named_parameters()}
    state = HookState(comp, names, None, 1, None, per_tensor)
    comp.codec.bind_engine(_Engine())
    gen = torch.Generator().manual_seed(seed)
    layouts = []
    for i, params in enumerate(buckets):
        offsets, at = [], 0
        for p in params:
            offsets.append(at)
            at += p.numel()
        layouts.append((i, params, offsets, at))
    counted = None
    for step in range(steps):
        grads = [torch.randn(size, generator=gen) * 1e-3 for _, _, _, size in layouts]
        with counting() if step == steps - 1 else contextlib.nullcontext() as counted_now:
            for (i, params, offsets, _), g in zip(layouts, grads):
                hook(state, _Bucket(i, g, params, offsets)).wait()
        counted = counted_now
    return counted


def main(argv):
    spec = argv[0] if argv else "thc"
    steps = int(argv[1]) if len(argv) > 1 else 2
    torch.set_num_threads(1)
    module, buckets = model_a_buckets()
    with gpu_paths():
        triton_calls, ops = hook_steps(spec, module, buckets, steps)
    print(json.dumps({"spec": spec, "buckets": len(buckets), "tensors": sum(len(b) for b in buckets),
                      "triton": dict(triton_calls), "torch": dict(ops), "triton_total": sum(triton_calls.values()),
                      "torch_total": sum(ops.values())}))


if __name__ == "__main__":
    main(sys.argv[1:])
