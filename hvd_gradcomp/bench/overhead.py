"""Compute overhead of every compressor: compress + decompress, collective excluded.

``python -m hvd_gradcomp.bench overhead [--quick] [--frameworks torch,tensorflow] ...``

What one timed *call* is:
    1. ``compress_tensor(scheme, ops, grad, state, info)`` (hvd_gradcomp.base), the same code
       path the Horovod adapters run, with ``info = TensorInfo(key, shape, "float32",
       world_size, rank=0)``.
    2. ``finish_tensor(...)`` on the payload exactly as compress returned it: the decoded
       output and the state after the step (as the adapters' ``decompress`` does).
    3. **Collective excluded**: the payload all-reduce is skipped. The default variants post
       no other collective; the blocking two-round variants (``blocking = True``, e.g.
       ``topkc:selection=current``) have their side all-reduce (``ops.allreduce``) replaced
       by the identity (:func:`hvd_gradcomp.primitives.one_rank`). The time is the
       compressor's own compute on this device, nothing else.
    4. The state returned is fed to the next call, so error feedback accumulates as in training.
    Each spec is a compressor: the scheme timed on a tensor is the one its routing picks for
    that tensor, as the adapters' (:class:`hvd_gradcomp.routing.Routing`; e.g. ``thc`` times a
    tensor below its ``min_numel``, 1024 by default, as fp16).

How it is timed:
    - Every compressor of one tensor is timed round-robin (one call each per round), so all of
      them see the same background load; FP16 is always among them and is the reference.
    - ``--warmup`` calls each first (TensorFlow: after one trace; the concrete function is
      reused), then rounds until ``--reps`` calls or ``--budget`` seconds per tensor (at least
      ``--min-reps``). The median is reported with the 10th-90th percentile spread.
    - CPU: the host clock around each call (CPU kernels run synchronously); ``--clock thread``
      (PyTorch, one thread): that thread's CPU time instead, on a machine shared with other
      jobs (the time slices others take are not counted; their memory traffic still is).
      ``--kernels both`` times each spec a second time with the core's reference kernels
      (row ``spec +ref``: no hand-written fused forms of ``torch_backend.kernels``, as with
      ``HVD_GRADCOMP_KERNELS=0``), in the same rounds. PyTorch on GPU:
      CUDA events around each call. TensorFlow on GPU (it has no device-event API): the host
      clock around one ``tf.function`` that runs the call ``--tf-inner`` times back to back
      and ends in one device sync; per-call time = sample / inner.

Columns (the table prints raw numbers first, then ratios; the CSV has the same fields):
    median_ms, p10_ms, p90_ms: per call.
    grad_gbps: gradient bytes (numel * 4) / median, in GB/s (1e9 bytes).
    payload_bytes, side_bytes, side_collectives: ``scheme.wire(info)`` (what would travel).
    floor_bytes: the bytes any implementation of the scheme must at least move through memory:
        gradient read once + result written once + state read and written once each +
        payload written and read once + side-collective buffers written and read once.
        (0 for ``none``, which hands the gradient over untouched.)
    floor_ms: floor_bytes / copy bandwidth, where the copy bandwidth is measured in the same run
        (``dst.copy_(src)`` of ``--copy-mib`` MiB, larger than the caches; bytes read + written
        per second; the best of the frameworks run on that device).
    vs_fp16: FP16 median / this median (>1 = cheaper than the FP16 cast; printed ``1.87x``).
    x_floor: median / floor_ms (1.00x = at memory speed; < 1 happens when the tensor stays in
        cache; large values mean extra passes, copies, sorting or per-call overhead).
    wire_vs_fp16: FP16 wire bytes / this scheme's wire bytes (payload + side), > 1 = fewer bytes.

Machine settings (their effect, measured: docs/bench.md, "The machine and the method"):
    - ``--malloc keep`` (default) calls glibc ``mallopt`` so freed memory is kept by the process
      (no mmap for large blocks, no trimming). Without it every temporary tensor above the
      mmap threshold is returned to the kernel when freed and page-faulted back in when the
      next one is allocated, which would be counted against whichever compressor makes the
      most temporaries. GPU frameworks cache their allocations anyway.
    - ``--threads 1`` (default on CPU): when other processes share the cores, a multi-thread
      kernel waits at its barrier for a descheduled thread.

Also writes scale-model inputs (``--model-inputs PATH``): the summed codec time and the wire
bytes of a reference model's gradient tensors per compressor (see ``model.py``).
"""
import argparse
import csv
import io
import json
import math
import os
import sys
import time

from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.primitives import itemsize, one_rank
from hvd_gradcomp.bench.launch import MALLOC_TRIM_THRESHOLD
from hvd_gradcomp.registry import SCHEMES, parse_spec
from hvd_gradcomp.routing import Routing

__all__ = ["main", "whole_model_table", "DDPHook", "COLUMNS", "DEFAULT_LAYERS", "no_collective", "floor_bytes", "measure",
           "apply_malloc_policy", "write_csv", "format_table"]

# Real layer shapes (PyTorch layout): a 3x3 conv kernel, a BERT-size linear and embedding.
DEFAULT_LAYERS = {
    "conv": ("conv 256x256x3x3", (256, 256, 3, 3)),
    "linear": ("linear 4096x1024", (4096, 1024)),
    "embedding": ("embedding 30000x512", (30000, 512)),
}

COLUMNS = ["framework", "device", "threads", "timer", "case", "shape", "numel", "scheme", "spec",
           "world_size", "reps", "median_ms", "p10_ms", "p90_ms", "grad_gbps", "payload_bytes",
           "side_bytes", "side_collectives", "floor_bytes", "floor_ms", "copy_gbps", "vs_fp16",
           "x_floor", "wire_vs_fp16", "first_call_s", "error"]

_REFERENCE = "fp16"
# A spec ending in this is timed with the backend's compiled kernels (``COMPILED_OPS``).
COMPILED = " +compile"
# A spec ending in this is timed with every kernel as the core's reference composition, without
# the hand-written fused forms of torch_backend.kernels (PyTorch's ``REFERENCE_OPS``; the same
# as the plain row in TensorFlow): ``--kernels both``.
UNFUSED = " +ref"


no_collective = one_rank  # ``ops`` with ``allreduce`` replaced by the identity (collective excluded)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def floor_bytes(scheme, info: TensorInfo, ops, state) -> int:
    """Bytes a scheme must at least move through memory per call (see the module docstring).

    Args:
        scheme: the scheme.
        info: the tensor's TensorInfo.
        ops: the backend's Primitives (to read the state tensors' shapes and dtypes).
        state: the scheme's state for this tensor (NamedTuple of tensors, or EmptyState).

    Returns:
        int bytes: 2 * gradient + 2 * state + 2 * payload + 2 * side (0 for identity schemes).
    """
    if getattr(scheme, "identity", False):
        return 0
    grad = info.numel * itemsize(info.dtype)
    state_bytes = sum(_numel(ops.shape(t)) * itemsize(ops.dtype(t)) for t in state)
    wire = scheme.wire(info)
    return 2 * grad + 2 * state_bytes + 2 * wire.payload + 2 * wire.side


def apply_malloc_policy(policy: str) -> str:
    """``"keep"``: ask glibc to keep freed memory (no mmap'd blocks, no trimming).

    Returns a short description of what was done (``"system"`` when nothing was, or when the
    C library has no ``mallopt``).
    """
    if policy != "keep":
        return "system"
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        # mallopt parameters from <malloc.h>: M_TRIM_THRESHOLD = -1, M_MMAP_MAX = -4; the
        # values of launch.MALLOC_KEEP_TUNABLES, which the TTA sweep gives its ranks.
        ok = libc.mallopt(-1, MALLOC_TRIM_THRESHOLD) == 1 and libc.mallopt(-4, 0) == 1
    except (OSError, AttributeError):
        return "system (no glibc mallopt)"
    return "keep (glibc: mmap off, trim off)" if ok else "system (mallopt refused)"


def _percentile(sorted_values, q):
    """Linear-interpolated percentile of an ascending list (q in [0, 100])."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


# ---------------------------------------------------------------------------------------
# Framework runners: each turns (scheme, info, gradient) into a timed callable.
# ---------------------------------------------------------------------------------------
class _TorchRunner:
    framework = "torch"

    def __init__(self, device, threads, cpu_clock=False):
        import torch
        from torch_backend.ops import COMPILED_OPS, OPS, REFERENCE_OPS
        self.torch = torch
        self.device = device  # "cpu" or "gpu"
        self.torch_device = "cuda" if device == "gpu" else "cpu"
        self.ops = no_collective(OPS)
        self.compiled_ops = no_collective(COMPILED_OPS)
        self.reference_ops = no_collective(REFERENCE_OPS)
        if threads and device == "cpu":
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads() if device == "cpu" else 0
        # --clock thread: this thread's CPU time (one thread runs every op inline), which a
        # loaded machine's time slices do not inflate (memory contention still does).
        self.clock = time.thread_time if (cpu_clock and device == "cpu" and self.threads == 1) else time.perf_counter
        self.timer = ("cuda-events" if device == "gpu" else
                      "thread-cpu" if self.clock is time.thread_time else "host")

    def tensor(self, array):
        return self.torch.from_numpy(array).to(self.torch_device)

    def prepare(self, scheme, info, grad, compiled=False, unfused=False):
        """A callable running one compress + finish call; returns (call, state0). ``unfused``:
        with ``REFERENCE_OPS`` (no fused kernels)."""
        torch = self.torch
        ops = self.compiled_ops if compiled else self.reference_ops if unfused else self.ops
        holder = [scheme.init(ops, info, grad)]

        def call():
            with torch.no_grad():
                payload, ctx = compress_tensor(scheme, ops, grad, holder[0], info)
                out, holder[0] = finish_tensor(scheme, ops, payload, ctx, holder[0], info)
            return out

        return call, holder[0]

    def timed(self, call):
        """One sample in seconds; returns a function yielding the value once synced."""
        if self.device == "gpu":
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            return lambda: start.elapsed_time(end) / 1e3
        t0 = self.clock()
        call()
        dt = self.clock() - t0
        return lambda: dt

    def sync(self):
        if self.device == "gpu":
            self.torch.cuda.synchronize()

    def copy_gbps(self, mib, reps=5):
        """Bytes read + written per second (GB/s) of ``dst.copy_(src)`` over ``mib`` MiB."""
        torch = self.torch
        n = mib * 2 ** 20 // 4
        src = torch.ones(n, dtype=torch.float32, device=self.torch_device)
        dst = torch.empty_like(src)
        samples = []
        for i in range(reps + 2):
            get = self.timed(lambda: dst.copy_(src))
            self.sync()
            if i >= 2:
                samples.append(get())
        return 2 * 4 * n / sorted(samples)[len(samples) // 2] / 1e9


class _TFRunner:
    framework = "tensorflow"

    def __init__(self, device, threads, inner):
        import tensorflow as tf
        from tf_backend.ops import COMPILED_OPS, OPS
        self.tf = tf
        self.device = device
        self.ops = no_collective(OPS)
        self.compiled_ops = no_collective(COMPILED_OPS)
        if threads and device == "cpu":
            try:
                tf.config.threading.set_intra_op_parallelism_threads(threads)
                tf.config.threading.set_inter_op_parallelism_threads(threads)
            except RuntimeError:  # TF already initialised in this process (e.g. under pytest)
                pass
        self.threads = tf.config.threading.get_intra_op_parallelism_threads() if device == "cpu" else 0
        self.inner = inner if device == "gpu" else 1
        self.tf_device = "/GPU:0" if device == "gpu" else "/CPU:0"
        self.timer = f"host-sync-batch{self.inner}" if device == "gpu" else "host"

    def tensor(self, array):
        with self.tf.device(self.tf_device):
            return self.tf.identity(self.tf.constant(array))

    def prepare(self, scheme, info, grad, compiled=False, unfused=False):
        tf, ops, inner = self.tf, self.compiled_ops if compiled else self.ops, self.inner
        with tf.device(self.tf_device):
            state0 = scheme.init(ops, info, grad)
        cls = type(state0)

        def step(g, *fields):
            st = cls(*fields)
            out = g
            for _ in range(inner):
                payload, ctx = compress_tensor(scheme, ops, g, st, info)
                out, st = finish_tensor(scheme, ops, payload, ctx, st, info)
            # A one-element slice of the result: fetching it waits for the whole call.
            return (out, tf.reshape(out, [-1])[:1]) + tuple(st)

        with tf.device(self.tf_device):
            fn = tf.function(step).get_concrete_function(grad, *state0)
        holder = [tuple(state0)]

        def call():
            with tf.device(self.tf_device):
                res = fn(grad, *holder[0])
            res[1].numpy()
            holder[0] = tuple(res[2:])
            return res[0]

        return call, state0

    def timed(self, call):
        t0 = time.perf_counter()
        call()
        dt = (time.perf_counter() - t0) / self.inner
        return lambda: dt

    def sync(self):
        pass

    def copy_gbps(self, mib, reps=5):
        """Bytes read + written per second (GB/s) of ``x * s`` (a fresh output) over ``mib`` MiB."""
        tf = self.tf
        n = mib * 2 ** 20 // 4
        with tf.device(self.tf_device):
            src = tf.ones([n], tf.float32)
            scale = tf.constant(1.0)
            fn = tf.function(lambda x, s: tf.reshape(x * s, [-1])[:1]).get_concrete_function(src, scale)
        samples = []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            fn(src, scale).numpy()
            if i >= 2:
                samples.append(time.perf_counter() - t0)
        return 2 * 4 * n / sorted(samples)[len(samples) // 2] / 1e9


class DDPHook:
    """One of PyTorch DDP's own communication hooks, timed on one gradient (rows ``ddp ...``).

    ``spec``: ``"fp16"`` (``default_hooks.fp16_compress_hook``) or ``"powersgd:rank=R"``
    (``powerSGD_hook`` with error feedback and warm start, as PyTorch's defaults; its first two
    steps are plain all-reduces, run as warm-up). DDP has no way to call a hook outside a
    backward pass, so a one-parameter module whose gradient is ``grad`` runs under DDP in a
    world of one Gloo rank (created once per process in a temporary file store), and the hook's
    own wall time is taken inside DDP (the hook call until its future's value is ready; it
    includes the one-rank Gloo all-reduce, a local copy). PyTorch on CPU only.

    Attributes:
        payload_bytes: bytes the hook would all-reduce per step (int): 2 per coordinate for
            fp16; ``4 R (rows + cols)`` for PowerSGD on a matrix view (rows = first dimension),
            4 per coordinate for 1-D tensors, which it sends uncompressed.
    """

    def __init__(self, spec: str, grad, world_size: int):
        import atexit
        import shutil
        import tempfile
        import torch
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel
        if grad.device.type != "cpu":
            raise ValueError("DDP hook rows run on CPU only (one-rank Gloo group)")
        if not dist.is_initialized():
            # the file store's file, in a folder only this process made (mkdtemp: no name race)
            folder = tempfile.mkdtemp(prefix="hvd-gradcomp-ddp-")
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, "store"),
                                    rank=0, world_size=1)
        name, options = parse_spec(spec)
        shape, numel = tuple(grad.shape), grad.numel()
        if name == "fp16":
            state, hook, self.payload_bytes = None, default_hooks.fp16_compress_hook, 2 * numel
        elif name == "powersgd":
            rank = int(options.get("rank", 1))
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                                start_powerSGD_iter=2)
            hook = powerSGD_hook.powerSGD_hook
            rows = shape[0] if len(shape) > 1 else 0
            self.payload_bytes = 4 * rank * (rows + numel // rows) if rows else 4 * numel
        else:
            raise ValueError(f"DDP hook must be fp16 or powersgd:rank=R, got {spec!r}")

        class _One(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.p = torch.nn.Parameter(torch.zeros(shape))

            def forward(self, g):
                return (self.p * g).sum()

        self._module = _One()
        self._ddp = DistributedDataParallel(self._module, bucket_cap_mb=numel * 4 / 2 ** 20 + 1)
        self._last = [0.0]

        def timed_hook(st, bucket):
            t0 = time.perf_counter()
            value = hook(st, bucket).wait()
            self._last[0] = time.perf_counter() - t0
            done = torch.futures.Future()
            done.set_result(value)
            return done

        self._ddp.register_comm_hook(state, timed_hook)
        self._grad = grad

    def timed(self):
        """Run one backward; returns a function giving the hook's time in seconds."""
        self._ddp(self._grad).backward()
        self._module.p.grad = None
        value = self._last[0]
        return lambda: value


def _devices(requested: str):
    """Devices to try, from 'cpu', 'gpu' or 'auto' (= cpu and gpu; a framework without a GPU
    skips the gpu runs)."""
    out = []
    for d in (d.strip() for d in requested.split(",")):
        if d == "auto":
            out += ["cpu", "gpu"]
        elif d in ("cpu", "gpu"):
            out.append(d)
        elif d:
            raise ValueError(f"overhead: device must be cpu, gpu or auto, got {d!r}")
    return list(dict.fromkeys(out))


def _runner(framework, device, args):
    if framework == "torch":
        if device == "gpu":
            import torch
            if not torch.cuda.is_available():
                return None
            return _TorchRunner("gpu", args.threads)
        return _TorchRunner("cpu", args.threads, args.clock == "thread")
    if framework == "tensorflow":
        import tensorflow as tf
        if device == "gpu" and not tf.config.list_physical_devices("GPU"):
            return None
        return _TFRunner(device, args.threads, args.tf_inner)
    raise ValueError(f"overhead: framework must be torch or tensorflow, got {framework!r}")


# ---------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------
def measure(runner, schemes, case, shape, *, world_size, warmup, reps, min_reps, budget, seed=0,
            copy_gbps=None, ddp_hooks=()):
    """Time every scheme on one tensor, round-robin. Returns a list of row dicts (COLUMNS).

    Args:
        runner: a framework runner (_TorchRunner / _TFRunner).
        schemes: [(spec text, Routing)], FP16 among them for the ratios; each tensor is timed
            with the scheme its routing decides (``Routing.decide``).
        case: label of the tensor ("flat 2^20", "conv 256x256x3x3").
        shape: tuple of ints.
        world_size: used for TensorInfo (payload sizes of some schemes depend on it).
        warmup, reps, min_reps, budget: see the module docstring (budget in seconds).
        copy_gbps: this device's copy bandwidth (GB/s) for the floor; None leaves floors empty.
        ddp_hooks: DDP hook specs (:class:`DDPHook`, PyTorch on CPU only) timed in the same
            rounds, as rows ``"ddp <spec>"``.
    """
    import numpy as np
    rng = np.random.default_rng(seed)
    numel = _numel(shape)
    grad = runner.tensor(rng.standard_normal(numel, dtype=np.float32).reshape(shape))
    info = TensorInfo(f"bench.{case}", tuple(shape), "float32", world_size, 0)
    live, rows = [], []
    for spec, routing in schemes:
        scheme = routing.bind(runner.ops).decide(None, info).scheme  # bound: the layout accepts() reads
        row = {"framework": runner.framework, "device": runner.device, "threads": runner.threads,
               "timer": runner.timer, "case": case, "shape": "x".join(map(str, shape)) or "()",
               "numel": numel, "scheme": routing.default.name, "spec": spec, "world_size": world_size,
               "reps": 0, "error": ""}
        rows.append(row)
        try:
            wire = scheme.wire(info)
            call, state0 = runner.prepare(scheme, info, grad, spec.endswith(COMPILED), spec.endswith(UNFUSED))
            row.update(payload_bytes=wire.payload, side_bytes=wire.side,
                       side_collectives=wire.side_collectives,
                       floor_bytes=floor_bytes(scheme, info, runner.ops, state0))
            t0 = time.perf_counter()
            call()  # the first call traces, and compiles the kernels of a compiled spec
            runner.sync()
            row["first_call_s"] = time.perf_counter() - t0
            for _ in range(warmup):
                call()
            runner.sync()
            live.append((row, lambda call=call: runner.timed(call), []))
        except Exception as exc:  # a scheme that fails is reported, the others still run
            row["error"] = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:200]
    for spec in ddp_hooks:
        row = {"framework": runner.framework, "device": runner.device, "threads": runner.threads,
               "timer": runner.timer, "case": case, "shape": "x".join(map(str, shape)) or "()",
               "numel": numel, "scheme": "ddp", "spec": f"ddp {spec}", "world_size": world_size,
               "reps": 0, "error": "", "side_bytes": 0, "side_collectives": 0}
        rows.append(row)
        try:
            hook = DDPHook(spec, grad, world_size)
            row["payload_bytes"] = hook.payload_bytes
            t0 = time.perf_counter()
            hook.timed()
            row["first_call_s"] = time.perf_counter() - t0
            for _ in range(max(warmup, 2)):  # PowerSGD's first steps are plain all-reduces
                hook.timed()
            live.append((row, hook.timed, []))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:200]
    start = time.perf_counter()
    rounds = 0
    while live and rounds < reps and (rounds < min_reps or time.perf_counter() - start < budget):
        pending = []
        for row, timed, samples in live:
            if row["error"]:
                continue
            try:
                pending.append((samples, timed()))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:200]
        runner.sync()
        for samples, get in pending:
            samples.append(get())
        rounds += 1
    for row, _, samples in live:
        if row["error"] or not samples:
            continue
        s = sorted(samples)
        med = _percentile(s, 50)
        row.update(reps=len(s), median_ms=med * 1e3, p10_ms=_percentile(s, 10) * 1e3,
                   p90_ms=_percentile(s, 90) * 1e3, grad_gbps=numel * 4 / med / 1e9)
        if copy_gbps:
            row["copy_gbps"] = copy_gbps
            if row.get("floor_bytes") is not None:
                row["floor_ms"] = row["floor_bytes"] / (copy_gbps * 1e9) * 1e3
                row["x_floor"] = med * 1e3 / row["floor_ms"] if row["floor_bytes"] else None
    ref = next((r for r in rows if r["scheme"] == _REFERENCE and r.get("median_ms")), None)
    for row in rows:
        if ref is not None and row.get("median_ms"):
            row["vs_fp16"] = ref["median_ms"] / row["median_ms"]
            ours = row["payload_bytes"] + row["side_bytes"]
            row["wire_vs_fp16"] = (ref["payload_bytes"] + ref["side_bytes"]) / ours if ours else None
    return rows


def _build_schemes(text, compile_mode="off", kernels="on"):
    """[(spec, Routing)] from compressor specs separated by spaces or ';' ("all" = every
    registered name but the adaptive ``auto``); ``Routing.from_spec`` of each (so ``thc:min_numel=512`` is accepted).

    FP16 (the reference of the ratios) is always first and never compiled. ``compile_mode``
    "both" adds a compiled row (spec + :data:`COMPILED`) after each other spec; "on" compiles
    every other spec; "off" none. ``kernels`` "both" adds an unfused row (spec +
    :data:`UNFUSED`: the reference kernels, no fused forms) after each other spec.
    """
    # auto is left out of "all": its cost is its choice's plus its measurement windows,
    # which this benchmark times on their own (its candidates).
    every = [name for name in sorted(SCHEMES) if not SCHEMES[name][1].adaptive]
    specs = []
    for token in text.replace(";", " ").split():
        specs.extend(every if token == "all" else [token])
    out, seen = [], set()
    for spec in [_REFERENCE] + specs:
        if spec in seen:
            continue
        seen.add(spec)
        routing = Routing.from_spec(spec)
        if spec == _REFERENCE or compile_mode != "on":
            out.append((spec, routing))
        if spec != _REFERENCE and kernels == "both":
            out.append((spec + UNFUSED, routing))
        if spec != _REFERENCE and compile_mode in ("on", "both"):
            out.append((spec + COMPILED, routing))
    return out


def _cases(args):
    cases = [(f"flat 2^{p}", (2 ** p,)) for p in range(args.min_log2, args.max_log2 + 1, args.step)]
    for name in [n.strip() for n in args.layers.split(",") if n.strip() and n.strip() != "none"]:
        if name not in DEFAULT_LAYERS:
            raise ValueError(f"overhead: unknown layer {name!r}; expected some of {sorted(DEFAULT_LAYERS)} or none")
        cases.append(DEFAULT_LAYERS[name])
    return cases


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------
def _fmt(value, kind):
    if value is None or value == "":
        return "-"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "ms":
        return f"{value:.3f}" if value < 100 else f"{value:.1f}"
    if kind == "mb":
        return f"{value / 1e6:.3f}" if value < 1e8 else f"{value / 1e6:.1f}"
    if kind == "f":
        return f"{value:.2f}"
    return str(value)


def format_table(rows, header_lines=()):
    """The human-readable table: definitions, then per framework/device a block of rows."""
    out = io.StringIO()
    out.write("Compress + decompress per call, COLLECTIVE EXCLUDED (payload all-reduce skipped; the\n"
              "side all-reduce of blocking variants = identity). Raw numbers first, then ratios:\n"
              "  median, p10-p90: ms per call; GB/s: gradient bytes (4 B/coord) / median;\n"
              "  wire MB: payload + side bytes per call; floor MB: bytes the scheme must at least\n"
              "  read+write (grad in, result out, state in+out, payload out+in, side out+in);\n"
              "  vs fp16 = FP16 median / ours (>1 = cheaper than the FP16 cast of the same tensor);\n"
              "  x floor = median / (floor MB / copy bandwidth) (1.00x = memory speed);\n"
              "  1st call s: the first call (tracing, and compiling for '+compile' rows).\n")
    for line in header_lines:
        out.write(line + "\n")
    groups = {}
    for r in rows:
        groups.setdefault((r["framework"], r["device"], r["threads"], r["timer"], r.get("copy_gbps")), []).append(r)
    cols = [("case", 20), ("numel", 10), ("spec", 22), ("median", 9), ("p10-p90", 17), ("GB/s", 7),
            ("wire MB", 9), ("floor MB", 9), ("vs fp16", 8), ("x floor", 8), ("1st call s", 10)]
    for (fw, dev, threads, timer, copy), group in groups.items():
        copy_txt = f"{copy:.1f} GB/s" if copy else "-"
        out.write(f"\n== {fw} on {dev} (threads={threads or 'default'}, timer={timer}, "
                  f"copy bandwidth {copy_txt} read+write)\n")
        out.write(" ".join(name.ljust(w) if i < 3 else name.rjust(w) for i, (name, w) in enumerate(cols)) + "\n")
        for r in group:
            if r["error"]:
                out.write(f"{r['case']:<20} {r['numel']:<10} {r['spec']:<22} ERROR {r['error']}\n")
                continue
            spread = f"{_fmt(r.get('p10_ms'), 'ms')}-{_fmt(r.get('p90_ms'), 'ms')}"
            wire = r["payload_bytes"] + r["side_bytes"]
            vals = [r["case"], str(r["numel"]), r["spec"], _fmt(r.get("median_ms"), "ms"), spread,
                    _fmt(r.get("grad_gbps"), "f"), _fmt(wire, "mb"), _fmt(r.get("floor_bytes"), "mb"),
                    _fmt(r.get("vs_fp16"), "x"), _fmt(r.get("x_floor"), "x"),
                    _fmt(r.get("first_call_s"), "f")]
            out.write(" ".join(v.ljust(w) if i < 3 else v.rjust(w)
                               for i, (v, (_, w)) in enumerate(zip(vals, cols))) + "\n")
    return out.getvalue()


def write_csv(rows, path):
    """Write rows with exactly COLUMNS (empty cells for missing values)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in COLUMNS})


# ---------------------------------------------------------------------------------------
# Scale-model inputs for a reference model
# ---------------------------------------------------------------------------------------
def model_inputs(runner, schemes, reference, *, world_size, warmup, reps, min_reps, budget,
                 copy_gbps, worker_counts, target_copy_gbps=None):
    """Per-compressor inputs of the scale model for a reference model's gradient tensors.

    Every distinct tensor shape is timed once (round-robin over the schemes) and counted as
    often as the model has it. ``codec_fixed_s`` sums, per tensor, ``min(t, t_small)`` where
    ``t_small`` is the scheme's time on a 64x64 tensor: the per-call cost that does not grow
    with size (op dispatch here, kernel launches on a GPU), which the scale model does not
    rescale. ``compute_s`` is the reference's assumed compute time
    (``model.REFERENCE_MODELS``); ``steps_to_target`` is None (equal to FP16's).

    Returns:
        ``{"meta": {...}, "compressors": {spec: {...}}}`` as ``model.load_inputs`` reads it;
        meta ``codec_scale`` = copy_gbps / target_copy_gbps when a target is given.
    """
    from hvd_gradcomp.bench.model import REFERENCE_MODELS
    ref = REFERENCE_MODELS[reference]
    counts = {}
    for shape in ref["shapes"]:
        counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    timing = dict(world_size=world_size, warmup=warmup, reps=reps, min_reps=min_reps, budget=budget,
                  copy_gbps=copy_gbps)
    small = {spec: row.get("median_ms") for (spec, _), row in
             zip(schemes, measure(runner, schemes, "64x64", (64, 64), **timing))}
    totals = {spec: {"codec_s": 0.0, "codec_fixed_s": 0.0, "payload_bytes": 0, "side_bytes": 0,
                     "side_collectives": 0,
                     "payload_bytes_by_workers": {str(n): 0 for n in worker_counts},
                     "side_bytes_by_workers": {str(n): 0 for n in worker_counts}}
              for spec, _ in schemes}
    errors = {}
    for shape, count in counts.items():
        rows = measure(runner, schemes, "x".join(map(str, shape)), shape, **timing)
        for (spec, routing), row in zip(schemes, rows):
            scheme = routing.decide(None, TensorInfo("bench", tuple(shape), "float32", 1, 0)).scheme
            if row["error"] or small[spec] is None:
                errors[spec] = row["error"] or "failed on the 64x64 tensor"
                continue
            t = totals[spec]
            t["codec_s"] += count * row["median_ms"] / 1e3
            t["codec_fixed_s"] += count * min(row["median_ms"], small[spec]) / 1e3
            t["payload_bytes"] += count * row["payload_bytes"]
            t["side_bytes"] += count * row["side_bytes"]
            t["side_collectives"] += count * row["side_collectives"]
            for n in worker_counts:
                key = str(n)
                if t["payload_bytes_by_workers"][key] is None:
                    continue
                try:
                    w = scheme.wire(TensorInfo(f"bench.{row['case']}", shape, "float32", n, 0))
                except ValueError:  # the scheme does not run at this world size (None = n/a)
                    t["payload_bytes_by_workers"][key] = t["side_bytes_by_workers"][key] = None
                    continue
                t["payload_bytes_by_workers"][key] += count * w.payload
                t["side_bytes_by_workers"][key] += count * w.side
        print(f"  reference tensor {shape} x{count}: done", file=sys.stderr, flush=True)
    compressors = {spec: dict(compute_s=ref["compute_s"], steps_to_target=None, **t)
                   for spec, t in totals.items() if spec not in errors}
    meta = {
        "reference": reference, "reference_note": ref["note"],
        "parameters": sum(_numel(s) for s in ref["shapes"]), "tensors": len(ref["shapes"]),
        "codec_measured_on": f"{runner.framework} {runner.device}, threads={runner.threads}, "
                             f"timer={runner.timer}, world_size={world_size}",
        "copy_gbps": copy_gbps,
        "errors": errors,
    }
    if target_copy_gbps:
        meta["codec_scale"] = copy_gbps / target_copy_gbps
        meta["codec_scale_note"] = (f"size-dependent codec time scaled by this machine's copy bandwidth "
                                    f"({copy_gbps:.1f} GB/s) over a target device's ({target_copy_gbps:g} GB/s)")
    return {"meta": meta, "compressors": compressors}


def whole_model_table(data) -> str:
    """One line per compressor: the codec time of one whole step of the reference model (every
    gradient tensor once, routed as the adapters route it), as measured on this device
    (``codec_s``, not rescaled), and its ratio to FP16's. ``data``: :func:`model_inputs`'s
    result."""
    meta, comps = data["meta"], data["compressors"]
    ref = comps.get(_REFERENCE, {}).get("codec_s")
    out = [f"whole model ({meta['reference']}, {meta['tensors']} tensors, {meta['parameters']:,} "
           f"parameters; {meta['codec_measured_on']}): codec time per step, x FP16's"]
    for spec, c in comps.items():
        ratio = f"{c['codec_s'] / ref:.2f}x" if ref else "-"
        out.append(f"  {spec:<36} {c['codec_s'] * 1e3:9.1f} ms  {ratio:>7}  "
                   f"wire {c['payload_bytes'] + c['side_bytes']:>12,} B, "
                   f"{c['side_collectives']} side collectives")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------
def _parser():
    p = argparse.ArgumentParser(prog="python -m hvd_gradcomp.bench overhead",
                                description="Compress + decompress cost per compressor and tensor "
                                            "size (collective excluded), against FP16 and a "
                                            "memory-traffic floor.")
    p.add_argument("--schemes", default="all",
                   help="specs separated by spaces or ';' (e.g. 'fp16 topkc:ratio=0.01 thc'); "
                        "'all' = every registered compressor with default options (default)")
    p.add_argument("--frameworks", default="torch,tensorflow")
    p.add_argument("--devices", default="auto", help="cpu, gpu or auto (cpu, plus gpu when present)")
    p.add_argument("--min-log2", type=int, default=12)
    p.add_argument("--max-log2", type=int, default=24, help="largest flat size 2^N (26 for the full range)")
    p.add_argument("--step", type=int, default=2, help="stride of log2 sizes (default 2)")
    p.add_argument("--layers", default="conv,linear,embedding", help="real layer shapes, or none")
    p.add_argument("--world-size", type=int, default=8, help="world size given to the schemes (wire sizes)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--budget", type=float, default=3.0, help="seconds per tensor after --min-reps")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per framework (0 = framework default)")
    p.add_argument("--tf-inner", type=int, default=10, help="TF on GPU: calls per synced sample")
    p.add_argument("--malloc", choices=("keep", "system"), default="keep")
    p.add_argument("--copy-mib", type=int, default=64, help="buffer size for the copy bandwidth")
    p.add_argument("--compile", choices=["off", "both", "on"], default="off",
                   help="time the schemes' kernels compiled (torch.compile / XLA): 'both' adds a "
                        "'+compile' row after each spec, 'on' compiles all but FP16")
    p.add_argument("--clock", choices=["host", "thread"], default="host",
                   help="PyTorch on CPU with --threads 1: 'thread' times each call in this thread's "
                        "CPU time (for a machine shared with other jobs; the copy bandwidth stays "
                        "host-timed); default: the host clock")
    p.add_argument("--kernels", choices=["on", "both"], default="on",
                   help="'both' adds a '+ref' row after each spec, timed with the reference kernels "
                        "(no hand-written fused forms, as HVD_GRADCOMP_KERNELS=0) in the same rounds")
    p.add_argument("--ddp-hooks", default="fp16;powersgd:rank=4",
                   type=lambda t: tuple(x.strip() for x in t.split(";") if x.strip() and x.strip() != "off"),
                   help="';'-separated DDP hooks timed as extra PyTorch CPU rows on the same tensors "
                        "(fp16, powersgd:rank=R; 'off' for none)")
    p.add_argument("--quick", action="store_true",
                   help="sizes 2^12..2^18, conv layer only, 5 reps, 0.5 s budget")
    p.add_argument("--out", default="runs/overhead", help="folder for overhead.csv / overhead.txt")
    p.add_argument("--model-inputs", default=None,
                   help="also time a reference model's tensors and write scale-model inputs (JSON) here")
    p.add_argument("--reference", default="resnet50", help="reference model for --model-inputs")
    p.add_argument("--model-only", action="store_true", help="with --model-inputs: skip the size sweep")
    p.add_argument("--target-copy-gbps", type=float, default=1500.0,
                   help="with --model-inputs: copy bandwidth (read+write GB/s) of the device the "
                        "model projects to; sets meta codec_scale (default 1500, an A100-class GPU; "
                        "0 = no scaling)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.min_log2, args.max_log2 = 12, min(args.max_log2, 18)
        args.layers = "conv" if args.layers == _parser().get_default("layers") else args.layers
        args.reps, args.budget = min(args.reps, 5), min(args.budget, 0.5)
    malloc = apply_malloc_policy(args.malloc)
    schemes = _build_schemes(args.schemes, args.compile, args.kernels)
    cases = _cases(args)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    devices = _devices(args.devices)
    timing = dict(world_size=args.world_size, warmup=args.warmup, reps=args.reps,
                  min_reps=min(args.min_reps, args.reps), budget=args.budget)
    runners = [r for r in (_runner(fw, dev, args) for dev in devices for fw in frameworks) if r]
    copy = {}
    for r in runners:
        copy[r.device] = max(copy.get(r.device, 0.0), r.copy_gbps(args.copy_mib))
    rows = []
    if not args.model_only:
        for r in runners:
            for case, shape in cases:
                hooks = args.ddp_hooks if (r.framework, r.device) == ("torch", "cpu") else ()
                rows.extend(measure(r, schemes, case, shape, copy_gbps=copy[r.device], ddp_hooks=hooks,
                                    **timing))
                print(f"  {r.framework}/{r.device} {case}: done", file=sys.stderr, flush=True)
    header = [f"malloc: {malloc}; world_size={args.world_size}; warmup={args.warmup}, "
              f"reps<={args.reps} (>= {timing['min_reps']}, budget {args.budget} s per tensor); "
              f"schemes: {', '.join(s for s, _ in schemes)}"]
    os.makedirs(args.out, exist_ok=True)
    if rows:
        table = format_table(rows, header)
        print(table)
        write_csv(rows, os.path.join(args.out, "overhead.csv"))
        with open(os.path.join(args.out, "overhead.txt"), "w") as f:
            f.write(table)
        print(f"wrote {os.path.join(args.out, 'overhead.csv')} and overhead.txt")
    if args.model_inputs:
        from hvd_gradcomp.bench.model import WORKERS
        first = runners[0]
        data = model_inputs(first, schemes, args.reference, copy_gbps=copy[first.device],
                            worker_counts=WORKERS, target_copy_gbps=args.target_copy_gbps or None,
                            **timing)
        data["meta"]["malloc"] = malloc
        print(whole_model_table(data))
        with open(args.model_inputs, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote scale-model inputs {args.model_inputs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
