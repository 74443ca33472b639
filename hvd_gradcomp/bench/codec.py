"""Codec cost per step for a many-tensor model against one flat tensor of the same size.

``python -m hvd_gradcomp.bench codec [--specs fp16,thc,...] [--steps 8] [--threads 1] [--device cuda]``

What it measures, per hook, on a one-process ``torch.distributed`` group (Gloo, or NCCL with
``--device cuda``; world size 1: the all-reduce is a copy, so what differs between hooks is the
codec):

- Model A: a 12-layer ``nn.TransformerEncoder`` (width 256, 4 heads, feed-forward 1024) with an
  embedding and a head over 256 tokens: 147 tensors, 9.61M parameters. Model B: one flat
  parameter of the same size (its gradient is a fixed vector).
- **ops**: ATen operations the PyTorch profiler records (all threads) during one training step
  (forward, backward and the hook; the median of three profiled steps), minus those of the same
  step under DDP's own ``allreduce_hook`` (its plain all-reduce as a comm hook, so DDP's
  per-parameter work for a hook is in both): what the hook's codec adds. On a GPU each is a kernel launch or a
  host-side dispatch.
- **launches** (``--device cuda`` only): GPU kernels the profiler's CUDA activity records in
  the same step, minus ``allreduce_hook``'s: what the GPU is given to run.
- **codec ms**: the median step time minus ``allreduce_hook``'s median step time, both
  timed round-robin in the same run (the same background load), per step and per million
  parameters. On CUDA each step is timed by CUDA events on the current stream, the device
  drained before it starts (so a launch-bound step's idle gaps count, as they do in training).

Rows: our compressors through :func:`torch_backend.ddp.register_comm_hook` (one codec call per
bucket and route), the same with ``per_tensor=True`` (one codec call per tensor: what the
Horovod path without groups does per gradient), and DDP's own ``fp16_compress_hook`` and
``powerSGD_hook`` (rank 4). The last columns are ratios: A's ops over B's, and our codec time
over DDP's own fp16 hook's.

``--kernels both`` adds a row ``ours +ref`` per spec: our hook with the core's reference
kernels (``HVD_GRADCOMP_KERNELS=0`` around its steps: no hand-written fused forms of
``torch_backend.kernels``), timed in the same rounds as the fused row ``ours``.

Timings follow the machine's load: run it on a quiet machine, and read the ratios measured
side by side in one run rather than the absolute figures. ``--clock process`` times each step
in this process's CPU time (all its threads) instead of the host clock: on a machine shared
with other jobs, the time slices they take are not counted (their memory traffic still is);
it is refused with ``--device cuda`` (the GPU's time is not the process's). A row whose hook
raises is printed with its error and the others go on.
"""
import argparse
import contextlib
import os
import socket
import statistics
import time

__all__ = ["main", "model_a", "model_b"]

DEFAULT_SPECS = "none,fp16,bf16,topkc:0.1,thc,signsgd,powersgd:4,auto"
PROFILED_STEPS = 3  # steps profiled per row; the ops columns are their median


def model_a(device="cpu"):
    """The 147-tensor transformer (module docstring) and a batch for it on ``device``:
    ``(module, loss_fn)``."""
    import torch
    from torch import nn

    class LM(nn.Module):
        def __init__(self, vocab=256, width=256, layers=12):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(width, vocab)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens)))

    torch.manual_seed(0)
    model = LM().to(device)
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1)).to(device)

    def loss(m):
        out = m(tokens)
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tokens.reshape(-1))
    return model, loss


def model_b(numel: int, device="cpu"):
    """One flat parameter of ``numel`` coordinates on ``device`` whose gradient is a fixed
    normal vector."""
    import torch
    from torch import nn

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.flat = nn.Parameter(torch.zeros(numel))

        def forward(self, g):
            return (self.flat * g).sum()

    g = torch.randn(numel, generator=torch.Generator().manual_seed(2)).to(device)
    return Flat().to(device), lambda m: m(g)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Row kind -> environment set around its steps (the unfused row: the reference kernels).
_UNFUSED = "ours +ref"
_ROW_ENV = {_UNFUSED: {"HVD_GRADCOMP_KERNELS": "0"}}


@contextlib.contextmanager
def _row_env(kind):
    """The environment of row ``kind`` (:data:`_ROW_ENV`) for the duration of its step."""
    env = _ROW_ENV.get(kind, {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# DDP's bucket_cap_mb for every row (--bucket-cap-mb); None: DDP's default.
_BUCKET_CAP_MB = None


def _make(kind, spec, build):
    """A fresh DDP model of ``build()`` with the hook ``kind`` ('ours', 'ours +ref',
    'per-tensor', 'ddp', 'plain') and ``spec``; returns (ddp model, loss function)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch_backend import Compression
    from torch_backend.ddp import register_comm_hook
    module, loss = build()
    ddp = DDP(module, **({} if _BUCKET_CAP_MB is None else {"bucket_cap_mb": _BUCKET_CAP_MB}))
    if kind in ("ours", _UNFUSED, "per-tensor"):
        register_comm_hook(ddp, Compression.from_spec(spec), per_tensor=kind == "per-tensor")
    elif kind == "plain":  # DDP's own all-reduce as a hook: what any comm hook costs DDP
        calls = []  # one entry per bucket all-reduced (the buckets of a step: _buckets)

        def plain(state, bucket):
            calls.append(bucket.index())
            return default_hooks.allreduce_hook(state, bucket)
        ddp.register_comm_hook(None, plain)
        ddp._hvd_gradcomp_bucket_calls = calls
    elif kind == "ddp" and spec == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "ddp":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=2, min_compression_rate=0.5,
                                            use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, _bucket_at_a_time(powerSGD_hook.powerSGD_hook))
    return ddp, loss


def _bucket_at_a_time(hook):
    """``hook`` with each bucket's future waited for before the next bucket's hook: DDP's
    ``powerSGD_hook`` waits on further all-reduces inside its future's callbacks, which on Gloo
    run on the process group's two worker threads; with several buckets in flight both threads
    can block in such callbacks while the all-reduces they wait for are queued behind them (a
    deadlock seen under pytest on model A's three buckets). The operations counted are the
    hook's own; its buckets no longer overlap each other, which on one rank costs little."""
    def wrapped(state, bucket):
        fut = hook(state, bucket)
        fut.wait()
        return fut
    return wrapped


def _step(ddp, loss):
    for p in ddp.parameters():
        p.grad = None
    loss(ddp).backward()


def _ops(ddp, loss, cuda=False, repeats=PROFILED_STEPS):
    """(ATen operations, GPU kernels or None) the profiler records in one step, on all threads:
    the median over ``repeats`` profiled steps. A callback that DDP chains on the all-reduce's
    future (the hook's decode) runs on this thread or on Gloo's, whichever finishes last; the
    profiler's default sees only this thread's, so its count moved between steps."""
    import torch
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        config = _ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # a PyTorch before the option: this thread's operations only
        config = _ExperimentalConfig()
    ops, kernels = [], []
    for _ in range(repeats):
        with profile(activities=activities, experimental_config=config) as prof:
            _step(ddp, loss)
            if cuda:
                torch.cuda.synchronize()
        events = prof.events()
        ops.append(sum(1 for e in events if e.name.startswith("aten::")))
        kernels.append(sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA))
    return statistics.median_low(ops), (statistics.median_low(kernels) if cuda else None)


def _timed_step(ddp, loss, clock, cuda):
    """Seconds of one step: ``clock`` on the host, or CUDA events after draining the device."""
    if not cuda:
        t0 = clock()
        _step(ddp, loss)
        return clock() - t0
    import torch
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _step(ddp, loss)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _buckets(ddp, loss) -> int:
    """DDP's buckets in one step of the 'plain' row's model (its hook counts its calls)."""
    calls = ddp._hvd_gradcomp_bucket_calls
    calls.clear()
    _step(ddp, loss)
    return len(calls)


def measure(rows, build, steps: int, warmup: int, clock=time.perf_counter, cuda=False):
    """{(kind, spec): (ops, kernels, median step s)} for each row of ``rows``, timed round-robin
    with ``clock`` (CUDA events where ``cuda``); a row whose hook raises maps to its error's
    text instead, and leaves the rounds."""
    models, out = {}, {}

    def attempt(row, fn):
        try:
            with _row_env(row[0]):
                return fn()
        except Exception as exc:  # noqa: BLE001 - reported in the row, the others go on
            out[row] = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
            models.pop(row, None)

    for row in rows:
        attempt(row, lambda: models.__setitem__(row, _make(*row, build)))
    for row in list(models):
        for _ in range(warmup):  # DDP rebuilds its buckets after the first step; auto settles
            if row in models:
                attempt(row, lambda: _step(*models[row]))
    ops = {}
    for row in list(models):
        counted = attempt(row, lambda: _ops(*models[row], cuda=cuda))
        if counted is not None:
            ops[row] = counted
    times = {row: [] for row in models}
    for _ in range(steps):
        for row in list(models):
            took = attempt(row, lambda: _timed_step(*models[row], clock, cuda))
            if took is not None:
                times[row].append(took)
    for row in models:
        out[row] = (*ops[row], statistics.median(times[row]))
    out["buckets"] = _buckets(*models[("plain", "-")]) if ("plain", "-") in models else 0
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m hvd_gradcomp.bench codec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", default=DEFAULT_SPECS, help=f"comma-separated specs (default {DEFAULT_SPECS})")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per row (median; default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--no-per-tensor", action="store_true", help="skip the per_tensor=True rows")
    ap.add_argument("--kernels", choices=["on", "both"], default="on",
                    help="'both' adds an 'ours +ref' row per spec with the reference kernels "
                         "(HVD_GRADCOMP_KERNELS=0 around its steps)")
    ap.add_argument("--clock", choices=["host", "process"], default="host",
                    help="'process': this process's CPU time per step (a shared machine); default "
                         "the host clock")
    ap.add_argument("--bucket-cap-mb", type=float, default=None,
                    help="DDP's bucket_cap_mb for every row (default DDP's, 25): model A's ops "
                         "over model B's follow its bucket count, printed with the table")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the models, gradients and codecs run (default cpu); cuda: NCCL, "
                         "CUDA events, and a launches column")
    args = ap.parse_args(argv)
    global _BUCKET_CAP_MB
    _BUCKET_CAP_MB = args.bucket_cap_mb
    import torch
    import torch.distributed as dist
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: this PyTorch sees no CUDA device (torch.cuda.is_available() is False)")
    if cuda and args.clock == "process":
        ap.error("--clock process times the host's CPU, not the GPU: use it with --device cpu")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    specs = [s.strip() for s in args.specs.split(",") if s.strip()]
    rows = [("plain", "-"), ("ddp", "fp16"), ("ddp", "powersgd:4")]
    for spec in specs:
        rows.append(("ours", spec))
        if args.kernels == "both":
            rows.append((_UNFUSED, spec))
        if not args.no_per_tensor:
            rows.append(("per-tensor", spec))
    a_module, _ = model_a()
    numel = sum(p.numel() for p in a_module.parameters())
    tensors = sum(1 for _ in a_module.parameters())
    clock = time.process_time if args.clock == "process" else time.perf_counter
    res_a = measure(rows, lambda: model_a(args.device), args.steps, args.warmup, clock, cuda)
    res_b = measure(rows, lambda: model_b(numel, args.device), args.steps, args.warmup, clock, cuda)
    try:
        import subprocess
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__)).stdout.strip() or "?"
    except OSError:
        commit = "?"
    mparams = numel / 1e6
    where = (f"CUDA ({torch.cuda.get_device_name(0)}, NCCL, CUDA events)" if cuda
             else f"CPU, {args.threads} thread(s), {args.clock} clock")
    print(f"codec cost per step, model A ({tensors} tensors, {mparams:.2f}M parameters) against "
          f"model B (1 tensor, same size); {where}; torch {torch.__version__}; commit {commit}")
    print(f"DDP buckets per step (bucket_cap_mb {args.bucket_cap_mb or 'default'}): model A "
          f"{res_a['buckets']}, model B {res_b['buckets']}; A/B of the ops is about the buckets "
          f"(and routes) per step, one codec call each")
    print("ops: ATen operations the hook adds to a step over DDP's allreduce_hook (profiler, all "
          "threads); " + ("launches: GPU kernels it adds likewise; " if cuda else "")
          + "codec ms: step time minus allreduce_hook's (medians, timed round-robin)")
    base = (res_a.get(("plain", "-")), res_b.get(("plain", "-")))
    if isinstance(base[0], str) or isinstance(base[1], str):
        print(f"allreduce_hook's row failed, nothing to subtract: {base}")
        dist.destroy_process_group()
        return 1
    print(f"allreduce_hook's step (subtracted below): model A {1e3 * base[0][2]:.2f} ms, model B "
          f"{1e3 * base[1][2]:.2f} ms")
    ddp_fp16 = res_a.get(("ddp", "fp16"))
    ref_a = ddp_fp16[2] - base[0][2] if isinstance(ddp_fp16, tuple) else 0.0
    launches = f" {'launch A':>8} {'launch B':>8}" if cuda else ""
    header = (f"{'hook':<12} {'spec':<14} {'ops A':>8} {'ops B':>7} {'A/B':>7}{launches} {'codec ms A':>10} "
              f"{'ms/Mparam':>9} {'codec ms B':>10} {'vs DDP fp16':>11}")
    print(header)
    print("-" * len(header))
    for row in rows[1:]:
        a, b = res_a.get(row), res_b.get(row)
        if isinstance(a, str) or isinstance(b, str):
            print(f"{row[0]:<12} {row[1]:<14} error: {a if isinstance(a, str) else b}")
            continue
        ops_a, ops_b = a[0] - base[0][0], b[0] - base[1][0]
        ms_a = 1e3 * (a[2] - base[0][2])
        ms_b = 1e3 * (b[2] - base[1][2])
        ratio = f"{ops_a / ops_b:.1f}x" if ops_b > 0 else "-"
        vs = f"{ms_a / (1e3 * ref_a):.2f}x" if ref_a > 0 else "-"
        kern = f" {a[1] - base[0][1]:>8d} {b[1] - base[1][1]:>8d}" if cuda else ""
        print(f"{row[0]:<12} {row[1]:<14} {ops_a:>8d} {ops_b:>7d} {ratio:>7}{kern} {ms_a:>10.2f} "
              f"{ms_a / mparams:>9.3f} {ms_b:>10.2f} {vs:>11}")
    dist.destroy_process_group()
    return 0
