"""The overhead benchmark's timing (``python -m hvd_gradcomp.bench overhead``, :mod:`.overhead`,
whose docstring says what one timed call is, how it is timed and what each column means): the
framework runners (PyTorch, TensorFlow, PyTorch DDP's own hooks), each turning (scheme, tensor
info, gradient) into a timed call, and :func:`measure`, which times every compressor on one
tensor round-robin into rows of :data:`COLUMNS`, with the memory-traffic floor
(:func:`floor_bytes`).
"""
import math
import os
import time

from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.primitives import itemsize, one_rank
from hvd_gradcomp.registry import parse_spec

__all__ = ["COLUMNS", "REFERENCE", "COMPILED", "UNFUSED", "no_collective", "floor_bytes",
           "TorchRunner", "TFRunner", "DDPHook", "parse_devices", "make_runner", "measure", "numel_of"]


COLUMNS = ["framework", "device", "threads", "timer", "case", "shape", "numel", "scheme", "spec",
           "world_size", "reps", "median_ms", "p10_ms", "p90_ms", "grad_gbps", "payload_bytes",
           "side_bytes", "side_collectives", "floor_bytes", "floor_ms", "copy_gbps", "vs_fp16",
           "x_floor", "wire_vs_fp16", "first_call_s", "error"]

REFERENCE = "fp16"
# A spec ending in this is timed with the backend's compiled kernels (``COMPILED_OPS``).
COMPILED = " +compile"
# A spec ending in this is timed with every kernel as the core's reference composition, without
# the hand-written fused forms of torch_backend.kernels (PyTorch's ``REFERENCE_OPS``; the same
# as the plain row in TensorFlow): ``--kernels both``.
UNFUSED = " +ref"


no_collective = one_rank  # ``ops`` with ``allreduce`` replaced by the identity (collective excluded)


def numel_of(shape) -> int:
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
    state_bytes = sum(numel_of(ops.shape(t)) * itemsize(ops.dtype(t)) for t in state)
    wire = scheme.wire(info)
    return 2 * grad + 2 * state_bytes + 2 * wire.payload + 2 * wire.side


def _percentile(sorted_values, q):
    """Linear-interpolated percentile of an ascending list (q in [0, 100])."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class TorchRunner:
    """PyTorch: one compress + finish call on ``OPS`` (or the compiled / reference table), timed
    by the host clock, this thread's CPU time (``cpu_clock``) or CUDA events."""

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


class TFRunner:
    """TensorFlow: ``inner`` calls in one traced ``tf.function`` per sample (one on CPU), timed by
    the host clock around a fetch of the result."""

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


def parse_devices(requested: str):
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


def make_runner(framework, device, args):
    """The runner of ``framework`` (``"torch"``/``"tensorflow"``) on ``device`` (``"cpu"``/
    ``"gpu"``), set from the command's ``args`` (``threads``, ``clock``, ``tf_inner``); None when
    the framework sees no GPU.

    Raises:
        ValueError: another framework.
    """
    if framework == "torch":
        if device == "gpu":
            import torch
            if not torch.cuda.is_available():
                return None
            return TorchRunner("gpu", args.threads)
        return TorchRunner("cpu", args.threads, args.clock == "thread")
    if framework == "tensorflow":
        import tensorflow as tf
        if device == "gpu" and not tf.config.list_physical_devices("GPU"):
            return None
        return TFRunner(device, args.threads, args.tf_inner)
    raise ValueError(f"overhead: framework must be torch or tensorflow, got {framework!r}")


def measure(runner, schemes, case, shape, *, world_size, warmup, reps, min_reps, budget, seed=0,
            copy_gbps=None, ddp_hooks=()):
    """Time every scheme on one tensor, round-robin. Returns a list of row dicts (COLUMNS).

    Args:
        runner: a framework runner (TorchRunner / TFRunner).
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
    numel = numel_of(shape)
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
    ref = next((r for r in rows if r["scheme"] == REFERENCE and r.get("median_ms")), None)
    for row in rows:
        if ref is not None and row.get("median_ms"):
            row["vs_fp16"] = ref["median_ms"] / row["median_ms"]
            ours = row["payload_bytes"] + row["side_bytes"]
            row["wire_vs_fp16"] = (ref["payload_bytes"] + ref["side_bytes"]) / ours if ours else None
    return rows
