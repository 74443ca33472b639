"""``auto``: each tensor gets the candidate compressor that pays, from measured cost and error.

Which compressor, and how hard, depends on the link, the tensor and the model (``docs/bench.md``):
at 1 Gbit/s TopKC and PowerSGD beat FP16 on digits, on a fast link nothing does, and small
tensors never pay. ``auto`` decides per tensor, online, from measurements taken in the job
itself, in the spirit of Espresso (Wang et al., EuroSys '23: a per-tensor plan from a cost
model) and L-GreCo (Markov et al., MLSys '24: per-layer parameters under an error budget),
but on stock Horovod's one all-reduce per tensor.

Candidates (option ``candidates``, ``|``-separated scheme specs, default
:data:`DEFAULT_CANDIDATES`): FP16 and the single-collective defaults of TopKC, THC and
PowerSGD at a few settings. ``fp16`` must be among them: it is the start and the fallback.

Schedule of one tensor, by its step ``t`` (compress calls so far, kept in the state):

1. Steps ``t`` with ``(t - warmup + 1) mod every`` in ``[every - warmup + 1, every]`` or
   ``t < warmup`` form a *window* of ``warmup`` steps ending at a *probe* step
   ``p = warmup - 1 + n * every``. On each window step, besides the real step, every
   candidate runs once on this rank's gradient as if it were alone (a *shadow*: its own
   state, world size 1, no collective), timed on the host (its codec time, ms, median over
   the window's steps after the first) and scored by its one-step error
   ``||c - out|| / ||c||`` (``c``: the gradient plus the shadow's pending error feedback;
   ``out``: what it delivers; mean over the window's steps after the first, whose agreed
   statistics, such as THC's ranges and TopKC's scores, start empty). That first step also
   screens: a candidate slower than :data:`PRUNE_FACTOR` times fp16's predicted step is not
   run again in the window and reports itself unusable (:meth:`AutoScheme._measure`).
2. The probe step sends, instead of the current candidate's payload, one float32 payload:
   the gradient plus the current candidate's pending error feedback (in the gradient's
   coordinates: :meth:`~hvd_gradcomp.base.Scheme.residual_of`), then ``1 + 2 C`` lanes: a 1
   (this rank contributes), and each candidate's codec ms and error. Its decoded result is
   exact (float32), so the error feedback is *flushed*: after a probe every residual is
   zero, and a change of scheme loses nothing. The lanes, summed by the same all-reduce and
   divided by the count lane, are the mean over the contributing ranks: the same numbers on
   every rank (Sum or Average alike; a joined rank contributes nothing).
3. :func:`decide`, a deterministic function of those numbers, the link (:class:`Link`,
   identical on every rank) and the current choice, picks the candidate for the next
   ``every`` steps: the least predicted time ``codec ms + ring all-reduce ms of its wire
   bytes`` (:func:`hvd_gradcomp.ring.ring_allreduce_seconds`) among those within the error
   budget (predictions within ``hysteresis`` of the least tie, and the lower error wins),
   switching only when that gains at least ``hysteresis`` (a fraction) over the current
   choice. fp16 is always allowed. A probe whose payload is not finite (some rank's
   gradient held a NaN/inf) decides nothing and leaves the state as it was.

The decision is read on the host once per window (``Primitives.to_host``: one device sync per
tensor per ``every`` steps); every other step is the chosen candidate's own step, with its
state kept under ``a_<field>`` in this scheme's state. Checkpoints hold the step, the choice
and that state, so a resumed job continues the schedule (and a state loaded on rank 0 only
gives the other ranks the same schedule).

The link: ``bandwidth_gbit`` (> 0) and ``latency_ms``, or measured when the compressor is built
(:meth:`hvd_gradcomp.adapter.HorovodCompressor.calibrate`: a few timed all-reduces, averaged
over the ranks so every rank holds the same figures); call ``calibrate()`` again, on every
rank, to refresh them. Without either, ``compress`` raises.

Limits: the schedule needs the step on the host, so in TensorFlow ``auto`` runs eagerly
(``GradientTape`` outside ``tf.function``, Keras ``run_eagerly=True``); inside ``tf.function``
it raises. Window steps cost every candidate's codec once more, and the shadows' residuals
(one per candidate with error feedback) live until the probe. The predicted time charges
codec and communication in full, without the overlap Horovod gives with the backward pass.
Ranks whose steps disagree (a rank that skipped compress calls) send payloads of different
dtypes at a probe step, which Horovod refuses with an error on every rank.
"""
import dataclasses
import logging
import math
import time
from collections import namedtuple
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from .base import Scheme, TensorInfo, WireBytes, compress_tensor, finish_tensor, poison
from .options import option, validate
from .ring import ring_allreduce_seconds

__all__ = ["AutoConfig", "AutoScheme", "Link", "Decision", "decide", "DEFAULT_CANDIDATES"]

log = logging.getLogger("hvd_gradcomp")

# fp16 first (the start and the fallback), then one setting of each family that trained as
# well as FP16 on digits (docs/bench.md). Every candidate costs its codec once more on each
# window step (eager THC alone was about 0.3 s a step on digits' 4.35M parameters), so the
# default list is short; widen it (e.g. "fp16|topkc:0.1|topkc:0.03|thc:2|thc:4|thc:8|
# powersgd:1|powersgd:4") for long runs, where windows are rare.
DEFAULT_CANDIDATES = "fp16|topkc:0.1|thc:4|powersgd:4"
FALLBACK = "fp16"
# A window's first (untimed) step screens the candidates: one slower than this many times
# fp16's predicted step for the tensor is not run again in that window (AutoScheme._measure).
PRUNE_FACTOR = 4.0
# The codec ms and error lanes of such a candidate: finite (a probe with a non-finite lane
# means a failed rank), and far beyond any budget and any other prediction once averaged.
UNUSABLE = 1e9


class Link(NamedTuple):
    """The network every decision assumes, identical on every rank.

    bytes_per_second: each rank's link rate, bytes/s, each direction.
    latency_s: fixed cost of one all-reduce, seconds.
    """

    bytes_per_second: float
    latency_s: float


class Decision(NamedTuple):
    """One probe's outcome for one tensor (host values, the same on every rank).

    choice: index of the chosen candidate; spec: its spec.
    predicted_ms: per candidate, codec ms + all-reduce ms of its wire bytes (inf when unknown).
    errors: per candidate, the measured one-step relative error.
    reason: why (``"least predicted time"``, ``"kept: gain below hysteresis"``, ...).
    step: the probe step (the tensor's own compress count, from 0).
    key: the tensor's key.
    """

    choice: int
    spec: str
    predicted_ms: tuple
    errors: tuple
    reason: str
    step: int
    key: str = ""


@dataclass(frozen=True)
class AutoConfig:
    """Options of ``auto`` (module docstring), each declared once below
    (:mod:`hvd_gradcomp.options`).

    ``error_budget`` bounds the one-step relative error ``||c - out|| / ||c||``, which error
    feedback makes large for every sparsifier and low-rank scheme that still trains well.
    Measured on digits' weight matrices (first 12 steps), against how each trained there
    (``docs/bench.md``): TopKC 0.1 0.87-0.91 and PowerSGD rank 4 0.73-0.86 reach FP16's
    accuracy; TopKC 0.03 0.96-0.97, PowerSGD rank 1 0.96 and TopKC 0.01 0.98-0.99 (which
    trains badly) deliver almost nothing of a step; THC 4 bits 0.2-0.3. The default 0.95
    admits the first group and shuts out the second. ``bandwidth_gbit=0`` (the default)
    means measured: ``calibrate()`` runs when the compressor is built after ``hvd.init()``.

    Raises:
        ValueError: an option outside its rule (``"auto: every must be ..."``), ``every`` below
            ``warmup``; the scheme raises for bad candidates (unknown, blocking, no fp16).
    """

    SCHEME: ClassVar[str] = "auto"
    candidates: str = option(DEFAULT_CANDIDATES, kind="text",
                             doc="'|'-separated scheme specs to choose from, fp16 among them")
    error_budget: float = option(0.95, kind="number", lo=0.0, lo_open=True,
                                 doc="largest one-step relative error a candidate may have")
    warmup: int = option(3, kind="integer", lo=2, doc="steps per measurement window (the first is not timed)")
    every: int = option(500, kind="integer", lo=2, doc="steps from one decision to the next (>= warmup)")
    hysteresis: float = option(0.1, kind="number", lo=0.0, hi=1.0, hi_open=True,
                               doc="least fraction of predicted time a switch must save")
    bandwidth_gbit: float = option(0.0, kind="number", lo=0.0,
                                   doc="link rate, Gbit/s; 0: measured by calibrate()")
    latency_ms: float = option(0.0, kind="number", lo=0.0,
                               doc="fixed cost of one all-reduce, ms (with bandwidth_gbit)")

    def __post_init__(self):
        if isinstance(self.candidates, (tuple, list)):
            object.__setattr__(self, "candidates", "|".join(self.candidates))
        validate(self)
        if self.every < self.warmup:
            raise ValueError(f"auto: every must be an integer >= warmup ({self.warmup}), got {self.every!r}")

    def specs(self) -> tuple:
        """The candidate specs, stripped."""
        return tuple(s.strip() for s in self.candidates.split("|"))


def decide(codec_ms, errors, wire_bytes, world_size: int, link: Link, current: int,
           fallback: int, budget: float, hysteresis: float):
    """The candidate for the next window: ``(choice, predicted_ms tuple, reason)``.

    A pure function of its arguments, so every rank that holds the same (all-reduced) inputs
    takes the same decision.

    The best is the candidate of least predicted time, except that candidates predicted within
    ``hysteresis`` of the least count as tied and the one of lower error among them wins
    (digits' largest weight: TopKC 0.1 at 51.4 ms and error 0.87 against PowerSGD rank 4 at
    50.8 ms and 0.79, which needs 115 steps to TopKC's 150).

    Args:
        codec_ms: per candidate, mean codec time (compress + decompress + finish), ms.
        errors: per candidate, mean one-step relative error (NaN: unknown, never chosen).
        wire_bytes: per candidate, payload bytes each rank hands to the all-reduce.
        world_size: ranks in the all-reduce.
        link: the :class:`Link`.
        current: index of the candidate in use; fallback: index of fp16 (always allowed).
        budget: largest accepted error; hysteresis: least fraction of predicted time a switch
            must save.
    """
    predicted = []
    for ms, nbytes in zip(codec_ms, wire_bytes):
        comm = ring_allreduce_seconds(nbytes, world_size, link.bytes_per_second, link.latency_s)
        total = ms + 1000.0 * comm
        predicted.append(total if math.isfinite(total) else math.inf)
    allowed = [i for i, e in enumerate(errors)
               if i == fallback or (math.isfinite(errors[i]) and e <= budget and math.isfinite(predicted[i]))]
    # Predictions within the hysteresis band of the least are a tie (measurement noise): the
    # lower error wins it, since it costs fewer extra steps.
    least = min(predicted[i] for i in allowed)
    near = [i for i in allowed if predicted[i] <= least * (1.0 + hysteresis)]
    best = min(near, key=lambda i: (errors[i] if math.isfinite(errors[i]) else 0.0, predicted[i], i))
    if best == current:
        return current, tuple(predicted), "least predicted time (unchanged)"
    if current in allowed and predicted[best] > (1.0 - hysteresis) * predicted[current]:
        return current, tuple(predicted), (f"kept: {predicted[best]:.3g} ms against "
                                           f"{predicted[current]:.3g} ms is below the hysteresis")
    why = "least predicted time" if current in allowed else "current choice over the error budget"
    return best, tuple(predicted), why


class _Ctx(NamedTuple):
    probe: bool
    choice: int
    step: int
    inner: object  # the candidate's ctx (run steps)


def _median(values):
    values = sorted(values)
    if not values:
        return math.nan
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


class AutoScheme(Scheme):
    """Per-tensor choice among candidate schemes (module docstring)."""

    name = "auto"
    adaptive = True  # wire() follows each tensor's current choice

    def __init__(self, config: AutoConfig = AutoConfig()):
        from .registry import make_scheme, parse_spec  # noqa: the registry imports this module
        self.config = config
        specs = config.specs()
        candidates = []
        for text in specs:
            name, options = parse_spec(text)
            if name == "auto":
                raise ValueError(f"auto: candidates must not include auto, got {text!r}")
            scheme = make_scheme(name, **options)
            if scheme.blocking:
                raise ValueError(f"auto: candidate {text!r} is a blocking variant (a side "
                                 f"collective inside compress); use the single-collective default")
            candidates.append(scheme)
        self.candidates = tuple(candidates)
        self.specs = tuple(c.spec() for c in candidates)
        if len(set(self.specs)) != len(self.specs):
            raise ValueError(f"auto: candidates must differ, got {list(self.specs)}")
        if FALLBACK not in self.specs:
            raise ValueError(f"auto: candidates must include {FALLBACK} (the start and the fallback), "
                             f"got {list(self.specs)}")
        self.fallback = self.specs.index(FALLBACK)
        self.scalable = all(c.scalable for c in candidates)
        self.rank_local_fields = tuple(sorted({"a_" + f for c in candidates for f in c.rank_local_fields}))
        self.link = None if not config.bandwidth_gbit else Link(
            config.bandwidth_gbit * 1e9 / 8, (config.latency_ms or 0.0) * 1e-3)
        self._at = {}  # key -> (step, choice): the state's counters, mirrored on the host
        self._shadows = {}  # key -> [shadow state per candidate] during a window
        self._samples = {}  # key -> [(times ms, errors)] per candidate during a window
        self._pruned = {}  # key -> indices of candidates not run again in this window
        self._types = {}  # field names -> (AutoState class, candidate state class)
        self.decisions = {}  # key -> the last Decision
        self.history = []  # every Decision of this process, in order (host values)

    def bind(self, ops):
        for c in self.candidates:
            c.bind(ops)
        return self

    def set_link(self, link: Link):
        """Use ``link`` (the same on every rank) from the next decision on."""
        self.link = Link(float(link[0]), float(link[1]))

    # ---- state ----
    def _state(self, ops, like, step: int, choice: int, inner):
        fields = ("step", "choice") + tuple("a_" + f for f in inner._fields)
        cls = self._types.get(fields)
        if cls is None:
            cls = self._types[fields] = (namedtuple("AutoState", fields), type(inner))
        return cls[0](ops.constant(step, "int64", like), ops.constant(choice, "int64", like), *inner)

    def _inner(self, state):
        return self._types[tuple(state._fields)][1](*state[2:])

    def init(self, ops, info: TensorInfo, like):
        """A fresh state (step 0, fp16): the tensor's host mirror starts over too."""
        self.forget(info.key)
        return self._state(ops, like, 0, self.fallback, self.candidates[self.fallback].init(ops, info, like))

    def init_like(self, ops, info: TensorInfo, like, loaded):
        """The fresh state of the loaded state's choice (its fields differ by choice)."""
        fields = dict(zip(getattr(loaded, "_fields", ()), loaded))
        choice = int(ops.to_host(fields["choice"])) if "choice" in fields else -1
        if not 0 <= choice < len(self.candidates):
            raise ValueError(f"auto: loaded state for tensor {info.key!r} has no valid choice "
                             f"(got {choice}; {len(self.candidates)} candidates)")
        return self._state(ops, like, 0, choice, self.candidates[choice].init(ops, info, like))

    def forget(self, key):
        """Drop the host mirror of ``key``'s counters (its state was replaced by a load)."""
        self._at.pop(key, None)
        self._shadows.pop(key, None)
        self._samples.pop(key, None)
        self._pruned.pop(key, None)

    def _position(self, ops, state, info):
        at = self._at.get(info.key)
        if at is None:
            at = self._at[info.key] = (int(ops.to_host(state.step)), int(ops.to_host(state.choice)))
        return at

    def _phase(self, step: int):
        """(in a window, is the probe) for ``step``."""
        cfg = self.config
        end = cfg.warmup - 1
        if step <= end:
            return True, step == end
        offset = (step - end) % cfg.every
        return offset == 0 or offset > cfg.every - cfg.warmup, offset == 0

    # ---- the step ----
    def compress(self, ops, x, state, info, finite):
        if not ops.eager():
            raise ValueError("auto: runs eagerly only (it reads its step on the host); in TensorFlow "
                             "call the tape outside tf.function, or Keras compile(run_eagerly=True)")
        if self.link is None:
            raise ValueError("auto: the link is unknown: build the compressor after hvd.init() (it "
                             "measures the link then), call compressor.calibrate() on every rank, or "
                             "pass bandwidth_gbit= and latency_ms=")
        step, choice = self._position(ops, state, info)
        window, probe = self._phase(step)
        inner = self._inner(state)
        if window:
            self._measure(ops, x, info, step)
        if probe:
            residual = self.candidates[choice].residual_of(ops, inner, info)
            flat = ops.reshape(x, (info.numel,))
            corrected = flat if residual is None else flat + residual
            payload = ops.concat([corrected, ops.constant(self._lanes(info.key), "float32", x)], 0)
            return poison(ops, payload, finite), _Ctx(True, choice, step, None)
        cand = self.candidates[choice]
        payload, ctx = cand.compress(ops, x, inner, info, finite if cand.guards_nonfinite else None)
        return payload, _Ctx(False, choice, step, ctx)

    def receive(self, ops, payload, ctx, info):
        if ctx.probe:
            return ctx
        return ctx._replace(inner=self.candidates[ctx.choice].receive(ops, payload, ctx.inner, info))

    def decompress(self, ops, payload, ctx, info):
        if ctx.probe:
            return payload[:info.numel]
        return self.candidates[ctx.choice].decompress(ops, payload, ctx.inner, info)

    def finish(self, ops, payload, ctx, state, info):
        inner = self._inner(state)
        if not ctx.probe:
            new = self.candidates[ctx.choice].finish(ops, payload, ctx.inner, inner, info)
            self._at[info.key] = (ctx.step + 1, ctx.choice)
            # Same fields as before: the counters move on the device (no new host tensors).
            return type(state)(state.step + 1, state.choice, *new)
        lanes = ops.to_host(payload[info.numel:])
        self._shadows.pop(info.key, None)
        self._samples.pop(info.key, None)
        self._pruned.pop(info.key, None)
        count = lanes[0]
        if not all(math.isfinite(v) for v in lanes) or count <= 0:
            # A rank failed this step: nothing decided, nothing flushed (the residual stays);
            # the schedule moves on, and the next window decides.
            self._at[info.key] = (ctx.step + 1, ctx.choice)
            return self._state(ops, payload, ctx.step + 1, ctx.choice, inner)
        cands = len(self.candidates)
        codec_ms = [lanes[1 + i] / count for i in range(cands)]
        errors = [lanes[1 + cands + i] / count for i in range(cands)]
        wire = [c.wire(info).payload for c in self.candidates]
        choice, predicted, reason = decide(codec_ms, errors, wire, info.world_size, self.link,
                                           ctx.choice, self.fallback, self.config.error_budget,
                                           self.config.hysteresis)
        decision = Decision(choice, self.specs[choice], predicted, tuple(errors), reason, ctx.step,
                            info.key)
        self.decisions[info.key] = decision
        self.history.append(decision)
        if choice != ctx.choice and info.rank == 0:
            log.info("hvd_gradcomp auto: tensor %s: %s -> %s at step %d (%s; predicted %.3g ms "
                     "against %.3g ms; error %.3g; %d payload bytes against fp16's %d)", info.key,
                     self.specs[ctx.choice], self.specs[choice], ctx.step, reason, predicted[choice],
                     predicted[ctx.choice], errors[choice], wire[choice], wire[self.fallback])
        if choice == ctx.choice:  # flushed: the same candidate goes on with no residual
            new = inner._replace(residual=inner.residual * 0.0) if "residual" in inner._fields else inner
        else:
            new = self.candidates[choice].init(ops, info, payload)
        self._at[info.key] = (ctx.step + 1, choice)
        return self._state(ops, payload, ctx.step + 1, choice, new)

    # ---- measurement ----
    def _measure(self, ops, x, info, step):
        """Run every candidate as a shadow on this rank's gradient (module docstring, step 1).

        A candidate whose first (untimed) window step took more than :data:`PRUNE_FACTOR` times
        fp16's predicted step for this tensor (its codec ms then plus its ring all-reduce ms)
        is not run again in this window: it cannot win, and it would cost its codec on every
        window step (eager THC on digits' 4M-coordinate weight: ~0.3 s a step). Its lanes then
        say so (:data:`UNUSABLE`), the same way on every rank after the all-reduce.
        """
        key = info.key
        alone = dataclasses.replace(info, world_size=1, rank=0, op="sum", group=None, dtype="float32")
        shadows = self._shadows.get(key)
        if shadows is None:
            shadows = self._shadows[key] = [c.init(ops, alone, x) for c in self.candidates]
            self._samples[key] = [([], []) for _ in self.candidates]
            self._pruned[key] = set()
            first, firsts = True, []
        else:
            first, firsts = False, None
        pruned = self._pruned[key]
        flat = ops.reshape(x, (info.numel,))
        for i, cand in enumerate(self.candidates):
            if i in pruned:
                continue
            before = cand.residual_of(ops, shadows[i], alone)
            start = time.perf_counter()
            payload, ctx = compress_tensor(cand, ops, x, shadows[i], alone)
            out, shadows[i] = finish_tensor(cand, ops, payload, ctx, shadows[i], alone)
            out = ops.reshape(out, (info.numel,))
            ops.to_host(ops.sum(out[:1], None))  # wait for the device before reading the clock
            elapsed = (time.perf_counter() - start) * 1000.0
            corrected = flat if before is None else flat + before
            diff = corrected - out
            num, den = ops.to_host(ops.concat([ops.reshape(ops.sum(diff * diff, None), (1,)),
                                               ops.reshape(ops.sum(corrected * corrected, None), (1,))], 0))
            if first:  # one-time costs and empty agreed stats: not a sample, only a screen
                firsts.append(elapsed)
            else:
                times, errors = self._samples[key][i]
                times.append(elapsed)
                errors.append(math.sqrt(num / den) if den > 0 else 0.0)
        if first and self.link is not None:
            f = self.fallback
            wire = self.candidates[f].wire(info).payload
            fp16_ms = firsts[f] + 1000.0 * ring_allreduce_seconds(
                wire, info.world_size, self.link.bytes_per_second, self.link.latency_s)
            pruned.update(i for i, ms in enumerate(firsts) if i != f and ms > PRUNE_FACTOR * fp16_ms)

    def _lanes(self, key):
        """``[1, codec ms per candidate, error per candidate]`` of this rank's window
        (:data:`UNUSABLE` for both of a pruned candidate)."""
        samples = self._samples.get(key) or [([], []) for _ in self.candidates]
        pruned = self._pruned.get(key, set())
        times = [UNUSABLE if i in pruned else _median(t) for i, (t, _) in enumerate(samples)]
        errors = [UNUSABLE if i in pruned else sum(e) / len(e) if e else math.nan
                  for i, (_, e) in enumerate(samples)]
        return [1.0] + times + errors

    # ---- facts ----
    def wire(self, info: TensorInfo) -> WireBytes:
        """The current choice's bytes (a probe step, once per window, sends float32 instead)."""
        choice = self._at.get(info.key, (0, self.fallback))[1]
        return self.candidates[choice].wire(info)

    def metrics(self, state) -> dict:
        return {"choice": state.choice, "step": state.step}

    def history_records(self) -> list:
        """Every decision so far as plain dicts, oldest first: ``key``, ``step`` (the probe
        step), ``scheme`` (the spec chosen), ``reason``, and per candidate spec its
        ``predicted_ms`` and ``errors`` (JSON-ready; NaN/inf as None)."""
        def num(v):
            return v if math.isfinite(v) else None
        return [{"key": d.key, "step": d.step, "scheme": d.spec, "reason": d.reason,
                 "predicted_ms": {s: num(v) for s, v in zip(self.specs, d.predicted_ms)},
                 "errors": {s: num(v) for s, v in zip(self.specs, d.errors)}} for d in self.history]

    def explain(self, key) -> dict:
        """Host facts of ``key``'s last decision: scheme, predicted ms, error, reason, bytes
        saved against fp16 per step are added by the adapter (``metrics()``); {} before one."""
        d = self.decisions.get(key)
        if d is None:
            at = self._at.get(key)
            return {} if at is None else {"scheme": self.specs[at[1]]}
        return {"scheme": d.spec, "predicted_ms": d.predicted_ms[d.choice],
                "fp16_predicted_ms": d.predicted_ms[self.fallback], "error": d.errors[d.choice],
                "reason": d.reason, "decided_at": d.step}


def _register():
    from .registry import register
    register("auto", AutoConfig, AutoScheme)


_register()
