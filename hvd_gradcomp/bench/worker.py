"""What every time-to-accuracy worker shares (framework-free; used by :mod:`.workers`).

A worker (``python -m hvd_gradcomp.bench.workers.<name>``) trains one model with one
compressor and writes one JSON file (rank 0) that the harness (:mod:`hvd_gradcomp.bench.tta_sweep`)
collects:

1. :func:`add_common_args`: the flags every worker takes (``--compression SPEC``, ``--seed``,
   ``--target``, ``--max-epochs``, ``--max-seconds``, ``--out`` ...).
2. :class:`TimedCompressor`: a proxy around a Horovod compressor that times its
   ``compress``/``decompress`` calls (eagerly run, as in PyTorch) and, separately, the side
   collectives issued inside ``compress`` (a synchronous all-reduce is communication, not
   compression).
3. :class:`Recorder`: per-step wall time split into compute / compress+decompress /
   communication, the loss, the metric on a schedule, and the stop rule. Rank 0 prints one
   progress line per evaluation (``@tta {json}``) that the harness turns into a progress bar.

The clock: ``t`` is the sum of the step times (evaluation excluded), in seconds. Start-up is
recorded apart from it, in wall-clock seconds (``time.time()``): ``meta["process_start"]``
(when this process started, from ``/proc``; where that is unreadable, when this module was
imported), ``meta["first_step_end"]`` (when the first step was recorded) and their difference
``meta["startup_s"]`` (process start, imports, Horovod init, model build, tracing and the
first step). Evaluation
happens every ``--eval-every`` steps on every rank (each on its shard of the held-out set,
summed by one small all-reduce), so the stop decision is identical on all ranks.

Stop rule: train until the rolling average (``--window`` evaluations) of the metric reaches
``--target``, then ``--epochs-past-target`` more epochs; or until ``--max-epochs`` or
``--max-seconds`` of training clock, whichever comes first.
"""
import json
import math
import os
import platform
import re
import sys
import threading
import time

__all__ = ["optimizer_class", "add_common_args", "TimedCompressor", "WaitTimer", "Recorder", "rolling_mean", "PROGRESS_PREFIX",
           "process_start_time", "parse_optimizer", "OPTIMIZERS"]

PROGRESS_PREFIX = "@tta "
# Optimizer names a row may give (``--optimizer NAME(k=v,...)``) -> (framework -> "module:class").
# Imported lazily by the workers, so a name whose class is not in this checkout yet fails in
# its own run with a clear message, not at import.
OPTIMIZERS = {
    "adam": {"torch": "torch.optim:Adam", "tensorflow": "tensorflow.keras.optimizers:Adam"},
    "adamw": {"torch": "torch.optim:AdamW", "tensorflow": "tensorflow.keras.optimizers:AdamW"},
    "sgd": {"torch": "torch.optim:SGD", "tensorflow": "tensorflow.keras.optimizers:SGD"},
    "frozen-adamw": {"torch": "torch_backend.optim:FrozenVarianceAdamW",
                     "tensorflow": "tf_backend.optim:FrozenVarianceAdamW"},
}
# Other spellings: the workers' earlier --optimizer choices (docs/optimizers.md).
OPTIMIZER_ALIASES = {"frozen_adamw": "frozen-adamw"}
_OPTIMIZER_TEXT = re.compile(r"^\s*([a-z][a-z0-9_-]*)\s*(?:\((.*)\))?\s*$")


def optimizer_class(name: str, framework: str):
    """The optimizer class ``OPTIMIZERS[name][framework]`` names, imported.

    Raises:
        ValueError: the class is not in this checkout (named, with the import error).
    """
    import importlib
    module, _, attr = OPTIMIZERS[name][framework].partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"optimizer {name}: {module}.{attr} is not available in this checkout "
                         f"({type(e).__name__}: {e})") from None


def parse_optimizer(text):
    """``"frozen-adamw(lr=1e-3,betas=0.9/0.98,freeze_step=100)"`` -> ``("frozen-adamw",
    {"lr": 0.001, "betas": (0.9, 0.98), "freeze_step": 100})``; ``""`` or ``"default"`` ->
    ``(None, {})`` (the workload's own optimizer); ``frozen_adamw`` is ``frozen-adamw``.

    Values are ints where they read as one, else floats; ``betas`` is ``b1/b2`` (a tuple);
    ``true``/``false`` are booleans. Whether the options suit the class is checked when it is
    built (its constructor's own errors).

    Raises:
        ValueError: not ``NAME`` or ``NAME(k=v,...)``, a name not in :data:`OPTIMIZERS`, an
            option that is not ``key=value``, or a value that is not a number.
    """
    if not text or not text.strip():
        return None, {}
    m = _OPTIMIZER_TEXT.match(text)
    if not m:
        raise ValueError(f"optimizer: expected NAME or NAME(key=value,...), got {text!r}")
    name, body = m.group(1), m.group(2) or ""
    name = OPTIMIZER_ALIASES.get(name, name)
    if name == "default":
        if body.strip():
            raise ValueError(f"optimizer: 'default' (the workload's own) takes no options, got {text!r}")
        return None, {}
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer: unknown name {name!r} in {text!r}; expected one of {sorted(OPTIMIZERS)}")
    opts = {}
    for item in (x.strip() for x in body.split(",")):
        if not item:
            continue
        key, eq, val = (x.strip() for x in item.partition("="))
        if not eq or not key or not val:
            raise ValueError(f"optimizer {name}: expected key=value, got {item!r}")
        try:
            if key == "betas":
                b1, slash, b2 = val.partition("/")
                if not slash:
                    raise ValueError(val)
                opts[key] = (float(b1), float(b2))
            elif val.lower() in ("true", "false"):
                opts[key] = val.lower() == "true"
            else:
                opts[key] = int(val) if re.fullmatch(r"[+-]?\d+", val) else float(val)
        except ValueError:
            raise ValueError(f"optimizer {name}: option {key} must be a number"
                             f"{' pair b1/b2' if key == 'betas' else ''}, got {val!r}") from None
    return name, opts
_IMPORTED_AT = time.time()


def process_start_time():
    """When this process started, as ``time.time()`` seconds (about 10 ms resolution).

    Read from Linux's ``/proc/self/stat`` (start time in clock ticks after boot) and
    ``/proc/uptime``; where those are unreadable, the time this module was imported (later
    than the true start by the interpreter's and the imports' start-up)."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, counted after "comm"
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_AT


def add_common_args(parser, *, target, higher_is_better, lr, batch_size, eval_every,
                    max_epochs, max_seconds=0.0, target_vs_fp16=0.0):
    """The flags every worker takes, with the workload's defaults."""
    g = parser.add_argument_group("time-to-accuracy run")
    g.add_argument("--compression", default="none",
                   help="compressor spec, e.g. fp16, topkc:ratio=0.01 (default none = FP32)")
    g.add_argument("--seed", type=int, default=0, help="model init and data order (default 0)")
    g.add_argument("--batch-size", type=int, default=batch_size, help="per worker")
    g.add_argument("--lr", type=float, default=lr)
    g.add_argument("--max-epochs", type=float, default=max_epochs)
    g.add_argument("--max-seconds", type=float, default=max_seconds,
                   help="stop after this much training clock (0 = no limit)")
    g.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0 = no limit)")
    g.add_argument("--target", type=float, default=target,
                   help=f"metric target ({'>=' if higher_is_better else '<='}, rolling average); "
                        "none: no target, train to the step/epoch/time budget")
    g.add_argument("--target-vs-fp16", type=float, default=target_vs_fp16,
                   help="recorded for the report: the target is this factor times the FP16 "
                        "row's final rolling metric in the same sweep (0: off, --target holds)")
    g.add_argument("--optimizer", default="",
                   help="the optimizer and its options instead of the workload's own, e.g. "
                        "'adamw(lr=1e-3,weight_decay=0.01)' or 'frozen-adamw(freeze_step=100)' "
                        f"(names: {', '.join(OPTIMIZERS)}; betas as b1/b2)")
    g.add_argument("--epochs-past-target", type=float, default=1.0,
                   help="epochs to keep training once the target is reached")
    g.add_argument("--eval-every", type=int, default=eval_every, help="steps between evaluations")
    g.add_argument("--window", type=int, default=5, help="evaluations in the rolling average")
    g.add_argument("--out", default=None, help="JSON result file (written by rank 0)")
    g.add_argument("--progress", action="store_true", help="print @tta progress lines (rank 0)")
    return g


def rolling_mean(values, window):
    """Trailing mean over the last ``window`` values at each position (shorter at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


class TimedCompressor:
    """Times a Horovod compressor's calls; Horovod sees only ``compress``/``decompress``.

    Args:
        inner: the compressor (e.g. ``torch_backend.Compression.from_spec(spec)``).
        side_module, side_attr: where the framework's synchronous all-reduce lives (e.g.
            ``horovod.torch``, ``"allreduce"``); while ``compress`` runs, calls to it are timed
            as communication (``side_s``) and excluded from ``compress_s``. None: not separated.
        sync: a callable draining the device (``--device cuda``: :func:`.device.sync_fn`),
            called before and after each compress/decompress; None: none (CPU).

    Use :meth:`take` once per step to read and reset ``(compress_s, decompress_s, side_s)``.
    Valid only where compress runs eagerly (PyTorch; not inside ``tf.function``).
    """

    def __init__(self, inner, side_module=None, side_attr="allreduce", sync=None):
        self.inner = inner
        # sync: drains the device before and after each call (--device cuda), so the times
        # are the codecs' kernels, not their launches; None on the CPU.
        self._sync = sync or (lambda: None)
        self.compress_s = self.decompress_s = self.side_s = 0.0
        self._inside = threading.local()
        self._patched = None
        if side_module is not None:
            original = getattr(side_module, side_attr)

            def timed_side(*args, **kwargs):
                if not getattr(self._inside, "on", False):
                    return original(*args, **kwargs)
                t0 = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.side_s += time.perf_counter() - t0

            setattr(side_module, side_attr, timed_side)
            self._patched = (side_module, side_attr, original)

    def compress(self, tensor):
        self._inside.on = True
        side0 = self.side_s
        self._sync()
        t0 = time.perf_counter()
        try:
            return self.inner.compress(tensor)
        finally:
            self._inside.on = False
            self._sync()
            self.compress_s += time.perf_counter() - t0 - (self.side_s - side0)

    def decompress(self, payload, ctx):
        self._sync()
        t0 = time.perf_counter()
        try:
            return self.inner.decompress(payload, ctx)
        finally:
            self._sync()
            self.decompress_s += time.perf_counter() - t0

    def take(self):
        """``(compress_s, decompress_s, side_s)`` since the last call; resets them."""
        out = (self.compress_s, self.decompress_s, self.side_s)
        self.compress_s = self.decompress_s = self.side_s = 0.0
        return out

    def bytes_per_step(self):
        return self.inner.bytes_per_step()

    def close(self):
        if self._patched is not None:
            module, attr, original = self._patched
            setattr(module, attr, original)
            self._patched = None


class WaitTimer:
    """Times the calls that block on the link while :meth:`watching`: patches the given
    functions of a module (e.g. ``horovod.torch``'s ``synchronize`` and ``allreduce``, looked
    up as ``hvd.synchronize`` at call time by the code being timed) for the life of the timer,
    and adds each call's seconds to ``wait_s`` while the ``watching()`` block runs (calls
    outside it, e.g. evaluation's all-reduce, are not counted). Nested patched calls are
    counted once (the outermost). :meth:`take` reads and resets; :meth:`close` restores the
    module (also on a failure: use it as a context manager or call ``close``).

    Args:
        module: the module whose attributes are patched.
        names: attribute names (functions) to time; a missing one is skipped.
        clock: ``() -> seconds`` (default ``time.perf_counter``; ``--device cuda``: a clock
            that drains the device first, :func:`.device.clock`).
    """

    def __init__(self, module, names, clock=None):
        self.module, self.wait_s = module, 0.0
        self._clock = clock or time.perf_counter
        self._state = threading.local()
        self._patched = []
        for name in names:
            original = getattr(module, name, None)
            if original is None:
                continue
            setattr(module, name, self._wrap(original))
            self._patched.append((name, original))

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            st = self._state
            if not getattr(st, "on", False) or getattr(st, "depth", 0):
                return fn(*args, **kwargs)
            st.depth = 1
            t0 = self._clock()
            try:
                return fn(*args, **kwargs)
            finally:
                st.depth = 0
                self.wait_s += self._clock() - t0
        return timed

    def watching(self):
        """Context manager: count the patched calls made inside it (this thread)."""
        timer = self

        class _On:
            def __enter__(self):
                timer._state.on = True

            def __exit__(self, *exc):
                timer._state.on = False
        return _On()

    def take(self):
        """Seconds waited since the last call; resets."""
        out, self.wait_s = self.wait_s, 0.0
        return out

    def close(self):
        for name, original in self._patched:
            setattr(self.module, name, original)
        self._patched = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Recorder:
    """Per-step and per-evaluation records of one run, the stop rule, and the JSON output.

    Args:
        args: the parsed flags of :func:`add_common_args`.
        rank, world_size: this process's place.
        steps_per_epoch: optimizer steps per epoch (same on all ranks).
        higher_is_better: True for accuracy, False for perplexity.
        meta: anything to record with the run (workload, model size, versions ...).
    """

    def __init__(self, args, rank, world_size, steps_per_epoch, higher_is_better, meta):
        self.args, self.rank, self.world_size = args, rank, world_size
        self.steps_per_epoch = steps_per_epoch
        self.higher = higher_is_better
        self.meta = dict(meta)
        self.meta.update(compression=args.compression, seed=args.seed, batch_size=args.batch_size,
                         lr=args.lr, target=args.target, world_size=world_size,
                         target_vs_fp16=getattr(args, "target_vs_fp16", 0.0) or None,
                         optimizer=getattr(args, "optimizer", "") or None,
                         higher_is_better=higher_is_better, steps_per_epoch=steps_per_epoch,
                         eval_every=args.eval_every, window=args.window,
                         epochs_past_target=args.epochs_past_target, max_epochs=args.max_epochs,
                         max_seconds=args.max_seconds, python=platform.python_version(),
                         argv=sys.argv)
        self.steps = {k: [] for k in ("step", "epoch", "t", "compute_s", "codec_s", "comm_s", "wait_s", "loss")}
        self.evals = {k: [] for k in ("step", "epoch", "t", "metric")}
        self.clock = 0.0
        self.step_count = 0
        self.reached_epoch = None
        self.stop_reason = None
        self.wall_start = time.time()
        self.process_start = process_start_time()
        self.first_step_end = None

    @property
    def max_steps(self) -> int:
        n = int(math.ceil(self.args.max_epochs * self.steps_per_epoch))
        return min(n, self.args.max_steps) if self.args.max_steps else n

    def step(self, compute_s, codec_s, comm_s, loss, wait_s=None):
        """Record one optimizer step (seconds; ``comm_s`` is clamped at 0).

        ``wait_s``: the part of ``comm_s`` the step was blocked waiting for the link (a
        collective's completion: Horovod's ``synchronize``, a blocking all-reduce; for an
        overlapped update sync, the wait for the round in flight), clamped to ``[0, comm_s]``;
        None: not measured by this worker (recorded as None, and the report then shows no
        wait share for the run)."""
        comm_s = max(0.0, comm_s)
        if wait_s is not None:
            wait_s = min(max(0.0, wait_s), comm_s)
        if self.first_step_end is None:
            self.first_step_end = time.time()
        self.step_count += 1
        self.clock += compute_s + codec_s + comm_s
        s = self.steps
        s["step"].append(self.step_count)
        s["epoch"].append(self.step_count / self.steps_per_epoch)
        s["t"].append(self.clock)
        s["compute_s"].append(compute_s)
        s["codec_s"].append(codec_s)
        s["comm_s"].append(comm_s)
        s["wait_s"].append(wait_s)
        s["loss"].append(float(loss))

    def due(self) -> bool:
        """True when an evaluation is scheduled after the step just recorded."""
        return self.step_count % self.args.eval_every == 0 or self.step_count >= self.max_steps

    def evaluate(self, metric, clock) -> bool:
        """Record an evaluation; returns True when training should stop (same on all ranks).

        Args:
            metric: the held-out metric, already combined over ranks.
            clock: the training clock agreed by the ranks (e.g. their mean), seconds.
        """
        e = self.evals
        epoch = self.step_count / self.steps_per_epoch
        e["step"].append(self.step_count)
        e["epoch"].append(epoch)
        e["t"].append(self.clock)
        e["metric"].append(float(metric))
        roll = rolling_mean(e["metric"], self.args.window)[-1]
        target = self.args.target
        meets = target is not None and (roll >= target if self.higher else roll <= target)
        if meets and self.reached_epoch is None:
            self.reached_epoch = epoch
        if self.rank == 0 and self.args.progress:
            print(PROGRESS_PREFIX + json.dumps({"step": self.step_count, "total": self.max_steps,
                                                "t": round(self.clock, 3), "metric": metric,
                                                "rolling": roll, "reached": self.reached_epoch is not None}),
                  flush=True)
        if not math.isfinite(metric):
            self.stop_reason = "diverged"
        elif self.reached_epoch is not None and epoch - self.reached_epoch >= self.args.epochs_past_target - 1e-9:
            self.stop_reason = "target+epochs"
        elif self.step_count >= self.max_steps:
            self.stop_reason = "max_steps" if self.args.max_steps and self.step_count >= self.args.max_steps \
                else "max_epochs"
        elif self.args.max_seconds and clock >= self.args.max_seconds:
            self.stop_reason = "max_seconds"
        return self.stop_reason is not None

    def write(self, bytes_per_step=None, extra=None, records=None):
        """Rank 0: write the JSON result to ``--out`` (no-op elsewhere or without --out).
        ``records``: more top-level keys of the result (e.g. ``adam``: the optimizer probe's)."""
        if self.rank != 0 or not self.args.out:
            return
        meta = dict(self.meta)
        meta.update(extra or {})
        meta.update(stop_reason=self.stop_reason or "max_epochs", steps_run=self.step_count,
                    wall_seconds=time.time() - self.wall_start, process_start=self.process_start,
                    first_step_end=self.first_step_end,
                    startup_s=None if self.first_step_end is None else self.first_step_end - self.process_start)
        result = {"meta": meta, "bytes_per_step": bytes_per_step, "steps": self.steps,
                  "evals": self.evals}
        result.update(records or {})
        tmp = self.args.out + ".tmp"
        os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, self.args.out)
