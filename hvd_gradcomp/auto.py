"""``auto``: each tensor gets the candidate compressor that pays, from measured cost and error.

Which compressor, and how hard, depends on the link, the tensor and the model (``docs/bench.md``):
at 1 Gbit/s TopKC and PowerSGD beat FP16 on digits, on a fast link nothing does, small tensors
never pay, and on the LM (Adam) no compressor beats FP16's time to accuracy at 500 Mbit/s.
``auto`` decides per tensor, online, from measurements taken in the job itself, in the spirit of
Espresso (Wang et al., EuroSys '23: a per-tensor plan from a cost model) and L-GreCo (Markov et
al., MLSys '24: per-layer parameters under an error budget), but on stock Horovod's one
all-reduce per tensor.

Candidates (option ``candidates``, ``|``-separated scheme specs, default
:data:`DEFAULT_CANDIDATES`): FP16 and the single-collective defaults of TopKC, THC and
PowerSGD at a few settings. ``fp16`` must be among them: it is the fallback.

Schedule of one tensor, by its step ``t`` (compress calls so far, kept in the state):

1. **Start.** Before anything is measured, every tensor starts on one *start candidate*
   (:func:`start_choice`), the one of least predicted time (``codec ms + all-reduce ms``) on
   a reference 1024 x 1024 matrix, with each candidate's codec ms measured there by
   ``calibrate()`` when the compressor is built and averaged over the ranks
   (:meth:`AutoScheme.reference_costs`); it must be :data:`START_FACTOR` times faster than
   fp16 there (and pass the step gate's test, step 5), and it runs
   only on the tensors where it saves at least ``hysteresis`` of fp16's bytes (not on vectors,
   which PowerSGD sends uncompressed); else fp16. With a given link (``bandwidth_gbit``) the
   codec is not measured and the start is the lossy candidate of fewest reference bytes, if
   it saves :data:`START_SAVING_S` there. One candidate for all tensors, because mixing
   schemes across layers in the first steps costs steps: on digits at 1 Gbit/s, fp16 on the
   2048 x 10 output layer for the first 3 steps while the other weights started on PowerSGD
   took 140 steps to 96 %, against 110 with every weight on one scheme and 115 for PowerSGD
   alone. And a compressed start that turns to fp16 costs steps too: on the unthrottled
   loopback, 3 PowerSGD steps before fp16 took digits 135 steps against fp16's 100, hence
   the measured codec. The first window's real steps then cost what the likely winner costs
   instead of fp16's dense all-reduce (digits at 1 Gbit/s: 31 ms a step for PowerSGD against
   132 ms for fp16). Only agreed facts enter, so every rank starts the same way.
2. **Window.** Steps ``t`` with ``(t - warmup + 1) mod every`` in ``[every - warmup + 1,
   every]`` or ``t < warmup`` form a window of ``warmup`` steps ending at a *probe* step
   ``p = warmup - 1 + n * every``. On each window step, besides the real step, every candidate
   runs once on this rank's gradient as if it were alone (a *shadow*: its own state, world
   size 1, no collective), timed on the host (its codec time, ms: the least over the window's
   steps after the first, since contention with the real step's all-reduce only ever adds)
   and scored by its one-step error ``||c - out|| / ||c||`` (``c``: the gradient plus the
   shadow's pending error feedback; ``out``: what it delivers; mean over the window's steps
   after the first, whose agreed statistics, such as THC's ranges and TopKC's scores, start
   empty). A candidate predicted :data:`PRUNE_FACTOR` times slower than the current choice
   from the start costs (step 1, scaled to the tensor's size) is not run at all in the
   window. The first step also screens: a candidate slower than :data:`PRUNE_FACTOR` times
   the fastest admissible one (and than :data:`PRUNE_MIN_MS`) is not run again in the window;
   both report themselves unusable
   (:meth:`AutoScheme._measure`).
3. **Probe.** The probe step is the current candidate's own step, with ``3 + 5 C`` *lanes*
   appended to its payload: a 1 (this rank contributes), each candidate's codec ms and error,
   this rank's *speedup* (step 5) and step ms, and the leading tensor's figures (step 4). Each lane is clamped to :data:`LANE_MAX` and pre-scaled
   by ``1 / world_size`` (as ``fp16`` pre-scales), so ``n`` ranks' float16 sum stays finite;
   the lanes, summed by the same all-reduce and divided by the count lane, are the mean over
   the contributing ranks, the same numbers on every rank (Sum or Average alike; a joined rank
   contributes nothing). A candidate whose payload Horovod may not scale (``scalable`` False:
   THC's integer words) cannot carry lanes: its probe sends instead one float32 payload, the
   gradient plus its pending error feedback (:meth:`~hvd_gradcomp.base.Scheme.residual_of`)
   plus the lanes, whose decoded result is exact, so its error feedback is *flushed*.
4. **Decision.** :func:`decide`, a deterministic function of those numbers, the link
   (:class:`Link`, identical on every rank) and the current choice, picks the candidate for
   the next ``every`` steps: the least predicted time ``codec ms + ring all-reduce ms of its
   wire bytes`` (:func:`hvd_gradcomp.ring.ring_allreduce_seconds`) among those within the
   error budget (predictions within ``hysteresis`` of the least tie, and the lower error
   wins), switching only when that gains at least ``hysteresis`` over the current choice
   (not at the first decision: the start was a guess). fp16 is always allowed. Then the
   *leading tensor's* choice: the lanes also carry, for the tensor with the most predicted
   fp16 time, each candidate's predicted ms and error and its current choice, so every tensor
   can repeat the leader's decision on agreed figures; a tensor takes the leader's choice
   instead of its own if that is within the error budget and costs it at most ``follow``
   times the measured step (lane: this rank's step, the least over the window, shadows'
   time taken off). One scheme
   across layers trains in fewer steps (step 1): on digits, PowerSGD everywhere but fp16 on
   the output layer (predicted 0.4 ms faster, 1 % of the step) took 180 steps to 96 %
   against 115 for PowerSGD on all of them. A probe whose lanes are not finite (some rank's
   gradient held a NaN/inf) decides nothing.
5. **Step gate.** A lossy choice (anything but fp16) costs extra steps to the same accuracy,
   which no per-tensor time sees: measured against FP16, +15 % for PowerSGD rank 4, +30-50 %
   for TopKC 0.1 and +35 % for THC on digits, +46 % for TopKC 0.3 and +208 % for TopKC 0.1 on
   the LM (Adam; ``docs/bench.md``). So each rank predicts, once per probe step, its whole
   step on the per-tensor best choices (``T_mix``) and on fp16 everywhere (``T_fp16``): its
   measured step (the least over the window's steps, shadows' time taken off) with each
   tensor's predicted time for its current choice replaced. The *speedup* ``T_fp16 / T_mix``
   rides in every tensor's lanes; a lossy choice stands only if the agreed speedup is at least
   ``1 + step_penalty`` (times ``1 - hysteresis`` for a tensor whose lossy choice was
   decided, not its start), else the tensor goes to fp16. The default 0.75 keeps the LM on
   fp16 (predicted speedup 1.22-1.42 at 500 Mbit/s and 1 Gbit/s, measured 1.12; held at a
   1.42 prediction, PowerSGD took it to 0.47x FP16's TTA) and lets digits compress
   (predicted 3-4 at 500 Mbit/s and 1 Gbit/s).
6. **Switch.** A change takes effect at the next step on every rank. The old candidate's
   pending error feedback (in the gradient's coordinates) is *carried*: added to the new
   candidate's residual (:meth:`~hvd_gradcomp.base.Scheme.add_residual`), or, for one that
   keeps none (fp16), held in this scheme's state as ``carry`` and added to the next step's
   gradient, then dropped once a step that carried it was delivered (a failed step keeps it).
   A float16 payload holds at most 65504 in all (each rank's part capped at 65504 / n, as
   every error-feedback payload is), so gradient plus carry is clamped there and what did not
   fit stays the carry for the next step: a carry of 1e6 owed by TopKC takes 16 finite fp16
   steps on 2 ranks instead of turning every later step inf. Nothing of the gradient is lost or sent twice, so the ranks' outputs plus their pending
   error feedback always sum to the summed gradients (except through a candidate built with
   ``error_feedback=False``, which drops what it does not send, carry included).

**Agreement.** Every rank must hand Horovod a payload of the same shape for a tensor, so the
schedule and the choice are agreed through the payload, as the fixed schemes' state is:

- Every step's payload ends in a *count lane* (``1 / n`` per rank, pre-scaled as the lanes; an
  integer payload: 1 under Sum, ``n`` under Average), so every rank sees how many contributed.
  A step counts (the step counter moves on) only if all ``n`` did: a rank that runs steps the
  others sit out in ``hvd.join()`` stays at the same step, and no probe decides from lanes some
  rank did not contribute to (a probe without every rank comes again at the next step). The
  counter advances on the device; the host mirror is checked against it at each probe (one
  read).
- A tensor's first compress after ``init`` or a load, or after the world size changed (an
  elastic reset), is a *sync step* on every rank: a float32 payload, the gradient plus all
  this rank owes (its residual and carry, as a flush), with the count lane and rank 0's step
  and choice. Every rank then takes rank 0's step and choice with a fresh state of that
  candidate (what each owed was delivered exactly); a sync step some rank missed or failed
  comes again. So a state loaded on rank 0 only (``state_dict(gather=True)``, the usual
  habit) or a fresh elastic worker is realigned within one step, never a shape mismatch. The
  price: a tensor's first step is a float32 all-reduce, and a resumed job's first step
  flushes its error feedback (the schedule continues; the outputs differ from going on).
- Not covered: a state loaded on one rank in the middle of a run while the others go on
  (only that rank syncs: Horovod reports a shape mismatch).

The decision is read on the host once per window (``Primitives.to_host``: one device sync per
tensor per ``every`` steps, one more on each step a carry is sent, and one on each step of a
half-precision gradient while the choice keeps no error feedback); every other step is the
chosen candidate's own step, with its state kept under ``a_<field>`` in this scheme's state.
Checkpoints hold the step, the choice and that state, so a resumed job continues the schedule
(and a state loaded on rank 0 only gives the other ranks the same schedule: *Agreement*).

The link: ``bandwidth_gbit`` (> 0) and ``latency_ms``, or measured when the compressor is built
(:meth:`hvd_gradcomp.adapter.HorovodCompressor.calibrate`: a few timed all-reduces, averaged
over the ranks so every rank holds the same figures); call ``calibrate()`` again, on every
rank, to refresh them. Without either, ``compress`` raises.

Limits: the schedule needs the step on the host, so in TensorFlow ``auto`` runs eagerly only:
``tf.config.run_functions_eagerly(True)``, since Horovod's ``DistributedGradientTape`` (and
Keras ``DistributedOptimizer``) all-reduce inside a ``tf.function`` of their own even when
called eagerly (a plain eager ``hvd.allreduce`` needs nothing); inside a graph it raises.
Window steps cost every candidate's codec once more, and the shadows' residuals (one per
candidate with error feedback) live until the probe. The predicted time charges
codec and communication in full, without the overlap Horovod gives with the backward pass;
the step gate's penalty is one number for every lossy candidate and model. Lanes in a float16
payload hold about 3 significant digits. With ``op`` unknown (``compress()`` called by hand)
the count lane is read as Horovod's default, Average.
"""
import dataclasses
import logging
import math
import time
from collections import namedtuple
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from .base import (FP16_MAX, Scheme, TensorInfo, WireBytes, compress_tensor, finish_tensor, fp16_floor,
                   payload_finite, poison)
from .options import option, validate
from .primitives import itemsize
from . import rng
from .ring import ring_allreduce_seconds

__all__ = ["AutoConfig", "AutoScheme", "Link", "Decision", "decide", "start_choice", "DEFAULT_CANDIDATES"]

log = logging.getLogger("hvd_gradcomp")

# fp16 first (the fallback), then one setting of each family that trained as well as FP16 on
# digits (docs/bench.md). Every candidate costs its codec once more on each window step (eager
# THC alone was about 0.3 s a step on digits' 4.35M parameters), so the default list is short;
# widen it (e.g. "fp16|topkc:0.1|topkc:0.03|thc:2|thc:4|thc:8|powersgd:1|powersgd:4") for long
# runs, where windows are rare.
DEFAULT_CANDIDATES = "fp16|topkc:0.1|thc:4|powersgd:4"
FALLBACK = "fp16"
# A window's first (untimed) step screens the candidates: one slower than this many times
# the fastest admissible one for the tensor is not run again in that window (AutoScheme._measure).
# First calls cost more than later ones (allocations, THC's first Sylvester matrix), hence > 1.
PRUNE_FACTOR = 2.5
# With a given link (no calibrate(), so no start costs), tensors start compressed only if the
# start candidate saves at least this much all-reduce time a step (seconds) on a
# REFERENCE_SHAPE matrix: PowerSGD rank 4 costs about 2.5 ms on it on one CPU core.
START_SAVING_S = 1e-3
REFERENCE_SHAPE = (1024, 1024)
# With start costs, the start candidate must be predicted this many times faster than fp16 on
# the reference matrix: the reference sees no compute, and a compressed start that the step
# gate then turns to fp16 costs steps (digits on the loopback: 135 against fp16's 100, where
# the reference predicted PowerSGD 2.5x faster and the gate 1.15-1.46x).
START_FACTOR = 3.0
# A window's first step prunes a candidate only if it also took at least this long (ms): on
# small tensors first calls cost a few ms of one-time work, and running them again is cheap.
PRUNE_MIN_MS = 5.0
# What calibrate() measured in this process, shared by every compressor built later with
# cached=True (their constructors): (backend, process set size, process set id, device) ->
# (Link, {candidate spec: codec ms on the reference matrix, the ranks' mean}).
CALIBRATIONS = {}
# Every lane is clamped to this before its 1/world_size pre-scale, so that n ranks' float16
# sum stays below 65504 (a codec of more than 30 s a step is unusable anyway).
LANE_MAX = 3e4
# The codec ms and error lanes of a pruned or unmeasured candidate: beyond any budget and any
# other prediction once averaged, and finite (a non-finite lane means a failed rank).
UNUSABLE = LANE_MAX


class Link(NamedTuple):
    """The network every decision assumes, identical on every rank.

    bytes_per_second: each rank's link rate, bytes/s, each direction (float32 payloads).
    latency_s: fixed cost of one all-reduce, seconds.
    fp16_bytes_per_second: the rate for float16/bfloat16 payloads (0: the same). On CPUs
        Gloo adds them in scalar code: on this project's loopback a float16 payload moved
        about 2.4x fewer bytes per second than a float32 one.
    """

    bytes_per_second: float
    latency_s: float
    fp16_bytes_per_second: float = 0.0

    def seconds(self, nbytes: float, world_size: int, dtype: str = "float32") -> float:
        """Ring all-reduce seconds of a ``dtype`` payload of ``nbytes`` over ``world_size``."""
        rate = self.fp16_bytes_per_second if dtype in ("float16", "bfloat16") else 0.0
        return ring_allreduce_seconds(nbytes, world_size, rate or self.bytes_per_second, self.latency_s)


class Decision(NamedTuple):
    """One probe's outcome for one tensor (host values, the same on every rank).

    choice: index of the chosen candidate; spec: its spec.
    predicted_ms: per candidate, codec ms + all-reduce ms of its wire bytes (at least
        :data:`UNUSABLE` when pruned).
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
    speedup: float = math.nan  # the agreed T_fp16 / T_mix of the step gate


def start_choice(wire_bytes, reference_bytes, world_size: int, link: Link, fallback: int,
                 hysteresis: float, reference_ms=None, step_penalty: float = 0.0,
                 dtypes=None) -> int:
    """The candidate a tensor starts on (module docstring, step 1).

    Args:
        wire_bytes: per candidate, this tensor's payload bytes.
        reference_bytes: per candidate, the payload bytes of a :data:`REFERENCE_SHAPE` matrix.
        world_size, link: the all-reduce's ranks and the :class:`Link`.
        fallback: index of fp16; hysteresis: the least fraction to save.
        reference_ms: per candidate, its codec ms on that matrix, averaged over the ranks
            (:meth:`AutoScheme.reference_costs`, measured by ``calibrate()``), or None when the
            link was given rather than measured.
        step_penalty: the step gate's (:class:`AutoConfig`).
        dtypes: per candidate, its payload dtype (None: float32), for :meth:`Link.seconds`.

    Returns the start candidate if it saves at least ``hysteresis`` of fp16's bytes on this
    tensor, else ``fallback``. With ``reference_ms``: the lossy candidate of least predicted
    time ``codec ms + bandwidth ms`` on the reference matrix (the latency, paid alike, left
    out), if that times ``max(START_FACTOR, 1 + step_penalty)`` is at most ``1 - hysteresis``
    times fp16's: the step gate's test with a margin, since compute, which the reference does
    not see, can only make the ratio worse. Without: the lossy one
    of fewest ``reference_bytes`` (ties to the earlier), if the link takes at least
    :data:`START_SAVING_S` less for them than for fp16's. A pure function of agreed facts.
    """
    lossy = [i for i in range(len(wire_bytes)) if i != fallback]
    if not lossy:
        return fallback

    dtypes = dtypes or ["float32"] * len(wire_bytes)

    def comm(i):  # bandwidth seconds of the reference matrix (the latency, paid alike, left out)
        return link.seconds(reference_bytes[i], world_size, dtypes[i]) - link.seconds(0, world_size)
    if reference_ms is None:
        start = min(lossy, key=lambda i: (reference_bytes[i], i))
        slow = comm(fallback) - comm(start) >= START_SAVING_S
    else:
        predicted = [ms + 1000.0 * comm(i) for i, ms in enumerate(reference_ms)]
        start = min(lossy, key=lambda i: (predicted[i], i))
        factor = max(START_FACTOR, 1.0 + step_penalty)
        slow = predicted[start] * factor <= (1.0 - hysteresis) * predicted[fallback]
    pays = wire_bytes[start] <= (1.0 - hysteresis) * wire_bytes[fallback]
    return start if slow and pays else fallback


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
    ``step_penalty`` is the step gate's (module docstring, step 5): compression must make the
    whole step at least ``1 + step_penalty`` times faster than fp16 everywhere; 0 turns the
    gate off.

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
    step_penalty: float = option(0.75, kind="number", lo=0.0,
                                 doc="fraction more steps a lossy choice is assumed to need (step gate)")
    follow: float = option(0.02, kind="number", lo=0.0,
                           doc="a tensor takes the leading tensor's choice if that costs it at most "
                               "this fraction of the step")

    def __post_init__(self):
        if isinstance(self.candidates, (tuple, list)):
            object.__setattr__(self, "candidates", "|".join(self.candidates))
        validate(self)
        object.__setattr__(self, "candidates", canonical_candidates(self.candidates))
        if self.every < self.warmup:
            raise ValueError(f"auto: every must be an integer >= warmup ({self.warmup}), got {self.every!r}")

    def specs(self) -> tuple:
        """The candidate specs, stripped."""
        return tuple(s.strip() for s in self.candidates.split("|"))


def canonical_candidates(text: str) -> str:
    """The one way to write a candidate list (:class:`AutoConfig` stores it so, so equal lists
    give equal specs and accept each other's checkpoints): each candidate as its scheme's
    canonical spec (:func:`~hvd_gradcomp.registry.to_spec`), lower case, no blanks, its main
    option (``PRIMARY``) written as a bare value when it is the only one, default or not:
    ``"FP16 | TopKC:ratio=0.1|thc"`` -> ``"fp16|topkc:0.1|thc:4"``. A candidate the registry
    does not know, or ``auto`` itself, is kept as written (the scheme refuses it)."""
    from .registry import PRIMARY, make_scheme, parse_spec  # noqa: the registry imports this module
    from .options import options_of
    out = []
    for item in text.split("|"):
        try:
            name, options = parse_spec(item)
        except ValueError:
            out.append(item.strip())
            continue
        if name == "auto":
            out.append(item.strip())
            continue
        scheme = make_scheme(name, **options)
        primary, spec = PRIMARY.get(name), scheme.spec()
        if primary is not None:
            rest = [o for o in spec.partition(":")[2].split(",") if o and not o.startswith(primary + "=")]
            if not rest:
                decl = options_of(scheme.config)[primary]
                spec = f"{name}:{decl.format(getattr(scheme.config, primary))}"
        out.append(spec)
    return "|".join(out)


def decide(codec_ms, errors, wire_bytes, world_size: int, link: Link, current: int,
           fallback: int, budget: float, hysteresis: float, dtypes=None):
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
        current: index of the candidate in use, or None at a tensor's first decision (its
            start was a guess from wire bytes alone, so no hysteresis holds it); fallback:
            index of fp16 (always allowed).
        budget: largest accepted error; hysteresis: least fraction of predicted time a switch
            must save.
        dtypes: per candidate, its payload dtype (None: float32), for :meth:`Link.seconds`.
    """
    predicted = []
    for ms, nbytes, dtype in zip(codec_ms, wire_bytes, dtypes or ["float32"] * len(wire_bytes)):
        total = ms + 1000.0 * link.seconds(nbytes, world_size, dtype)
        predicted.append(total if math.isfinite(total) else math.inf)
    allowed = [i for i, e in enumerate(errors)
               if i == fallback or (math.isfinite(errors[i]) and e <= budget and math.isfinite(predicted[i]))]
    # Predictions within the hysteresis band of the least are a tie (measurement noise): the
    # lower error wins it, since it costs fewer extra steps.
    least = min(predicted[i] for i in allowed)
    near = [i for i in allowed if predicted[i] <= least * (1.0 + hysteresis)]
    best = min(near, key=lambda i: (errors[i] if math.isfinite(errors[i]) else 0.0, predicted[i], i))
    if current is None:
        return best, tuple(predicted), "first decision: least predicted time"
    if best == current:
        return current, tuple(predicted), "least predicted time (unchanged)"
    if current in allowed and predicted[best] > (1.0 - hysteresis) * predicted[current]:
        return current, tuple(predicted), (f"kept: {predicted[best]:.3g} ms against "
                                           f"{predicted[current]:.3g} ms is below the hysteresis")
    why = "least predicted time" if current in allowed else "current choice over the error budget"
    return best, tuple(predicted), why


class _Ctx(NamedTuple):
    probe: str  # "": a plain step; "ride": lanes after the candidate's payload; "flush": float32
    choice: int
    step: int
    inner: object  # the candidate's ctx ("" and "ride")
    shape: tuple  # the candidate's own payload's shape ("ride"; its lanes follow it flattened)
    carried: bool  # the state's carry was added to this step's gradient
    unsent: object  # what of gradient + carry the float16 payload could not hold (None: all fits)


def _saturate_carried(ops, x, world_size: int):
    """``(sent, unsent)``: ``x`` (float32, the gradient plus the carry) with its finite values
    clamped to what a float16 payload pre-scaled by ``1 / world_size`` holds (the largest
    float16 <= 65504 / n, times n: :func:`~hvd_gradcomp.base.saturating_cast`'s cap), and the
    excess, kept as the next carry (module docstring, step 6). NaN/inf stay (a failed step must
    be seen as one); their excess is 0."""
    limit = world_size * fp16_floor(FP16_MAX / world_size)
    finite = ops.isfinite(x)
    sent = ops.where(finite, ops.clip(x, -limit, limit), x)
    return sent, ops.where(finite, x - sent, 0.0 * x)


def _count_lane(info, dtype):
    """This rank's count lane in a payload of ``dtype``: ``1 / n`` (float; pre-scaled as the
    probe's lanes), or for an integer payload 1 under Sum and ``n`` otherwise (Horovod's
    integer Average truncates ``k n / n`` to ``k``)."""
    if dtype.startswith("int"):
        return 1 if info.op == "sum" else info.world_size
    return 1.0 / info.world_size


def _contributors(count, info, dtype):
    """The number of contributing ranks from the all-reduced count lane (a host number or a
    0-d tensor): Sum adds ``1 / n`` per rank, Average divides that by ``n`` once more; an
    unknown op is taken as Horovod's default, Average."""
    n = info.world_size
    if dtype.startswith("int"):
        return count
    return count * n if info.op == "sum" else count * (n * n)


def _delivered(ops, own, carry, unsent):
    """The carry after a step that carried it: ``unsent`` flattened (None when it is 0 or
    None) if the all-reduced ``own`` payload is finite, else ``carry`` (one host read)."""
    if unsent is None:
        return None if ops.to_host(payload_finite(ops, own)) else carry
    ok, most = ops.to_host(ops.concat([ops.reshape(ops.cast(payload_finite(ops, own), "float32"), (1,)),
                                       ops.reshape(ops.max(ops.abs(unsent), None), (1,))], 0))
    if not ok:
        return carry
    return ops.reshape(unsent, ops.shape(carry)) if most > 0 else None


def _alone_step(cand, ops, x, state, info):
    """One step of ``cand`` on ``x`` as if alone (``info``: world size 1): ``(out`` float32
    ``[numel]``, new state, host ms)``, the device waited for before the clock is read."""
    start = time.perf_counter()
    payload, ctx = compress_tensor(cand, ops, x, state, info)
    out, state = finish_tensor(cand, ops, payload, ctx, state, info)
    out = ops.reshape(out, (info.numel,))
    ops.to_host(ops.sum(out[:1], None))
    return out, state, (time.perf_counter() - start) * 1000.0


class AutoScheme(Scheme):
    """Per-tensor choice among candidate schemes (module docstring)."""

    name = "auto"
    adaptive = True  # wire() follows each tensor's current choice

    def __init__(self, config: AutoConfig = None):
        from .registry import make_scheme, parse_spec  # noqa: the registry imports this module
        config = AutoConfig() if config is None else config
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
            raise ValueError(f"auto: candidates must include {FALLBACK} (the fallback), "
                             f"got {list(self.specs)}")
        self.fallback = self.specs.index(FALLBACK)
        self.scalable = all(c.scalable for c in candidates)
        self.rank_local_fields = tuple(sorted({"carry"} | {"a_" + f for c in candidates
                                                           for f in c.rank_local_fields}))
        self.link = None if not config.bandwidth_gbit else Link(
            config.bandwidth_gbit * 1e9 / 8, (config.latency_ms or 0.0) * 1e-3)
        self.start_costs = None  # agreed codec ms per candidate on the reference matrix
        self._at = {}  # key -> (step, choice): the state's counters, mirrored on the host
        self._shadows = {}  # key -> [shadow state per candidate] during a window
        self._samples = {}  # key -> [(times ms, errors)] per candidate during a window
        self._firsts = {}  # key -> [(screen ms, screen error) per candidate] of the window's first step
        self._pruned = {}  # key -> indices of candidates not run again in this window
        self._infos = {}  # key -> TensorInfo of the tensors in a window
        self._clock = {}  # step -> [host time of the step's first compress, shadow seconds]
        self._gate = (None, None)  # (probe step, this rank's step lanes for it: _round)
        self._types = {}  # field names -> (AutoState class, candidate state class)
        self.decisions = {}  # key -> the last Decision
        self.history = []  # every Decision of this process, in order (host values)

    def bind(self, ops):
        for c in self.candidates:
            c.bind(ops)
        return self

    def set_link(self, link: Link, start_costs=None):
        """Use ``link`` (the same on every rank) from the next decision on, and
        ``start_costs`` (per candidate, codec ms on the reference matrix averaged over the
        ranks, or None) for the start of tensors not seen yet."""
        self.link = Link(*(float(v) for v in link))
        self.start_costs = None if start_costs is None else tuple(float(v) for v in start_costs)

    def reference_costs(self, ops, like) -> list:
        """This rank's codec ms of every candidate on a :data:`REFERENCE_SHAPE` Gaussian
        matrix, as if alone (compress + finish; the least of two timed calls after an untimed
        first). ``calibrate()`` averages them over the ranks for :func:`start_choice`."""
        info = TensorInfo("auto.reference", REFERENCE_SHAPE, "float32", 1, 0, "sum")
        x = ops.reshape(rng.normal(ops, rng.stream_key("auto.reference"), info.numel, like),
                        REFERENCE_SHAPE)
        costs = []
        for cand in self.candidates:
            state, runs = cand.init(ops, info, x), []
            for i in range(3):
                _, state, ms = _alone_step(cand, ops, x, state, info)
                if i:
                    runs.append(ms)
            costs.append(min(min(runs), LANE_MAX))
        return costs

    # ---- state ----
    def _pack(self, step, choice, inner, carry):
        """An AutoState of the counters (tensors), the optional carry and ``inner``'s fields."""
        kept = () if carry is None else (carry,)
        fields = ("step", "choice") + (() if carry is None else ("carry",)) + \
            tuple("a_" + f for f in inner._fields)
        cls = self._types.get(fields)
        if cls is None:
            cls = self._types[fields] = (namedtuple("AutoState", fields), type(inner))
        return cls[0](step, choice, *kept, *inner)

    def _state(self, ops, like, step: int, choice: int, inner, carry=None):
        return self._pack(ops.constant(step, "int64", like), ops.constant(choice, "int64", like),
                          inner, carry)

    def _inner(self, state):
        cls = self._types[tuple(state._fields)][1]
        return cls(*(v for f, v in zip(state._fields, state) if f.startswith("a_")))

    def _with(self, state, inner, carry):
        """``state`` with its counters moved on by one on the device (no new host tensors)."""
        return self._pack(state.step + 1, state.choice, inner, carry)

    def init(self, ops, info: TensorInfo, like):
        """A fresh state at step 0 on the start choice (:func:`start_choice`); the tensor's
        host mirror starts over too."""
        self.forget(info.key)
        reference = dataclasses.replace(info, key="auto.reference", shape=REFERENCE_SHAPE,
                                        dtype="float32")
        choice = self.fallback if self.link is None else start_choice(
            [c.wire(info).payload for c in self.candidates],
            [c.wire(reference).payload for c in self.candidates], info.world_size, self.link,
            self.fallback, self.config.hysteresis, self.start_costs, self.config.step_penalty,
            self._dtypes(reference))
        return self._state(ops, like, 0, choice, self.candidates[choice].init(ops, info, like))

    def init_like(self, ops, info: TensorInfo, like, loaded):
        """The fresh state of the loaded state's choice (its fields differ by choice), with a
        zero ``carry`` if the loaded state holds one."""
        fields = dict(zip(getattr(loaded, "_fields", ()), loaded))
        choice = int(ops.to_host(fields["choice"])) if "choice" in fields else -1
        if not 0 <= choice < len(self.candidates):
            raise ValueError(f"auto: loaded state for tensor {info.key!r} has no valid choice "
                             f"(got {choice}; {len(self.candidates)} candidates)")
        carry = ops.zeros((info.numel,), "float32", like) if "carry" in fields else None
        return self._state(ops, like, 0, choice, self.candidates[choice].init(ops, info, like), carry)

    def forget(self, key):
        """Drop the host mirror of ``key``'s counters (its state was replaced by a load), and
        the window's step clock and cached step lanes (their step numbers may come again)."""
        for table in (self._at, self._shadows, self._samples, self._firsts, self._pruned, self._infos):
            table.pop(key, None)
        self._clock.clear()
        self._gate = (None, None)

    def residual_of(self, ops, state, info):
        """The pending error feedback in the gradient's coordinates: the current candidate's
        plus the ``carry``; None when there is neither."""
        own = self.candidates[int(ops.to_host(state.choice))].residual_of(ops, self._inner(state), info)
        carry = getattr(state, "carry", None)
        if carry is None or own is None:
            return own if carry is None else carry
        return own + carry

    def add_residual(self, ops, state, info, residual):
        """``state`` with ``residual`` (float32 ``[numel]``, the gradient's coordinates) added
        to the current candidate's error feedback, or, for one that keeps none, to the
        ``carry`` (created only when ``residual`` is not all 0: one host read). Used by
        :func:`~hvd_gradcomp.base.finish_tensor` for what a half-precision output could not
        hold."""
        at = self._at.get(info.key)
        choice = at[1] if at is not None else int(ops.to_host(state.choice))
        inner = self._inner(state)
        carry = getattr(state, "carry", None)
        absorbed = self.candidates[choice].add_residual(ops, inner, info, residual)
        if absorbed is not None:
            return self._pack(state.step, state.choice, absorbed, carry)
        if carry is None:
            if not ops.to_host(ops.max(ops.abs(residual), None)) > 0:
                return state
            return self._pack(state.step, state.choice, inner, residual)
        return self._pack(state.step, state.choice, inner, carry + residual)

    def _position(self, ops, state, info):
        """``(step, choice, sync)`` of ``info``'s tensor for this compress (module docstring,
        *Agreement*): ``sync`` at the first compress after an init or a load, or when the world
        size changed (its state is not known to be the other ranks'); at a probe of the host
        mirror the state's step is read (a step some rank missed did not count)."""
        at = self._at.get(info.key)
        if at is None or at[2] != info.world_size:
            return int(ops.to_host(state.step)), int(ops.to_host(state.choice)), True
        step, choice, world = at
        if self._phase(step)[1]:
            true = int(ops.to_host(state.step))
            if true != step:
                step = true
                self._at[info.key] = (step, choice, world)
        return step, choice, False

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
                             "call tf.config.run_functions_eagerly(True) (Horovod's "
                             "DistributedGradientTape and DistributedOptimizer all-reduce inside a "
                             "tf.function of their own, even when called eagerly)")
        if self.link is None:
            raise ValueError("auto: the link is unknown: build the compressor after hvd.init() (it "
                             "measures the link then), call compressor.calibrate() on every rank, or "
                             "pass bandwidth_gbit= and latency_ms=")
        step, choice, sync = self._position(ops, state, info)
        window, probe = self._phase(step)
        if window:
            self._clock.setdefault(step, [time.perf_counter(), 0.0])
            self._measure(ops, x, info, step)
        inner = self._inner(state)
        carry = getattr(state, "carry", None)
        cand = self.candidates[choice]
        unsent = None
        if carry is not None:
            x = x + ops.reshape(carry, ops.shape(x))
            if cand.scalable and cand.payload_dtype(info) == "float16":
                x, unsent = _saturate_carried(ops, x, info.world_size)
        if sync or (probe and not cand.scalable):  # the float32 flush (step 3; Agreement)
            residual = cand.residual_of(ops, inner, info)
            flat = ops.reshape(x, (info.numel,))
            corrected = flat if residual is None else flat + residual
            tail = self._sync_lanes(info, step, choice) if sync else self._lanes(info, step)
            payload = ops.concat([corrected, ops.constant(tail, "float32", x)], 0)
            return poison(ops, payload, finite), _Ctx("sync" if sync else "flush", choice, step, None, (),
                                                      carry is not None, None)
        payload, ctx = cand.compress(ops, x, inner, info, finite if cand.guards_nonfinite else None)
        shape = tuple(ops.shape(payload))
        dtype = ops.dtype(payload)
        if probe:
            lanes = poison(ops, ops.constant(self._lanes(info, step), dtype, x), finite)
        else:  # one count lane (Agreement)
            lanes = ops.constant([_count_lane(info, dtype)], dtype, x)
        flat = ops.reshape(payload, (math.prod(shape),))
        return ops.concat([flat, lanes], 0), _Ctx("ride" if probe else "", choice, step, ctx, shape,
                                                  carry is not None, unsent)

    @staticmethod
    def _own(ops, payload, ctx):
        """The candidate's part of the all-reduced payload, in its own shape."""
        return ops.reshape(payload[:math.prod(ctx.shape)], ctx.shape)

    def receive(self, ops, payload, ctx, info):
        if ctx.probe in ("flush", "sync"):
            return ctx
        return ctx._replace(inner=self.candidates[ctx.choice].receive(ops, self._own(ops, payload, ctx), ctx.inner, info))

    def decompress(self, ops, payload, ctx, info):
        if ctx.probe in ("flush", "sync"):
            return payload[:info.numel]
        return self.candidates[ctx.choice].decompress(ops, self._own(ops, payload, ctx), ctx.inner, info)

    def finish(self, ops, payload, ctx, state, info):
        inner = self._inner(state)
        carry = getattr(state, "carry", None)
        n = info.world_size
        if ctx.probe in ("flush", "sync"):
            new, lanes = inner, ops.to_host(payload[info.numel:])
            if ctx.probe == "sync":
                return self._synced(ops, payload, ctx, state, info, lanes)
        else:
            own = self._own(ops, payload, ctx)
            new = self.candidates[ctx.choice].finish(ops, own, ctx.inner, inner, info)
            if ctx.carried:  # delivered: what did not fit is the new carry; a failed step keeps it
                carry = _delivered(ops, own, carry, ctx.unsent)
            if not ctx.probe:  # the step counts only if every rank contributed (no host read)
                count = ops.cast(payload[math.prod(ctx.shape)], "float32")
                full = _contributors(count, info, ops.dtype(payload)) >= n - 0.5
                self._at[info.key] = (ctx.step + 1, ctx.choice, n)  # probes read the state's step
                return self._pack(state.step + ops.cast(full, "int64"), state.choice, new, carry)
            lanes = ops.to_host(ops.cast(payload[math.prod(ctx.shape):], "float32"))
        count = lanes[0]
        finite = all(math.isfinite(v) for v in lanes)
        if finite and not _contributors(count, info, "float32") >= n - 0.5:
            # Some rank sat this step out (hvd.join()): nothing decided, the step does not
            # count (the probe comes again); a flush delivered what this rank sent.
            if ctx.probe == "flush":
                new, carry = self._flushed(ops, inner), None
            self._at[info.key] = (ctx.step, ctx.choice, n)
            return self._pack(state.step, state.choice, new, carry)
        for table in (self._shadows, self._samples, self._firsts, self._pruned, self._infos):
            table.pop(info.key, None)
        if not finite:
            # A rank failed this step: nothing decided, nothing flushed (the states stay as the
            # candidate's finish left them); the schedule moves on, and the next window decides.
            self._at[info.key] = (ctx.step + 1, ctx.choice, n)
            return self._state(ops, payload, ctx.step + 1, ctx.choice, new, carry)
        if ctx.probe == "flush":  # exact: the residual and the carry are delivered
            new, carry = self._flushed(ops, inner), None
        cands = len(self.candidates)
        codec_ms = [lanes[1 + i] / count for i in range(cands)]
        errors = [lanes[1 + cands + i] / count for i in range(cands)]
        speedup, step_ms = lanes[1 + 2 * cands] / count, lanes[2 + 2 * cands] / count
        lead = [v / count for v in lanes[3 + 2 * cands:]]
        wire = [c.wire(info).payload for c in self.candidates]
        cfg = self.config
        current = None if ctx.step == cfg.warmup - 1 else ctx.choice
        choice, predicted, reason = decide(codec_ms, errors, wire, info.world_size, self.link,
                                           current, self.fallback, cfg.error_budget, cfg.hysteresis,
                                           self._dtypes(info))
        # The leading tensor's decision, from its agreed figures (the same on every rank).
        held = lead[2 * cands:]
        leader = decide([v - 1000.0 * self.link.seconds(0, info.world_size) for v in lead[:cands]],
                        lead[cands:2 * cands], [0] * cands, info.world_size, self.link,
                        held.index(max(held)) if max(held) > 0.5 else None, self.fallback,
                        cfg.error_budget, cfg.hysteresis)[0]
        if leader != choice and (leader == self.fallback or errors[leader] <= cfg.error_budget) \
                and predicted[leader] - predicted[choice] <= cfg.follow * step_ms:
            reason = (f"follows the leading tensor's choice: {predicted[leader] - predicted[choice]:.3g} ms "
                      f"more, below follow x step ({cfg.follow:.3g} x {step_ms:.3g} ms)")
            choice = leader
        # A lossy current choice is held by the hysteresis; the start is not (a guess: held,
        # it kept the LM on PowerSGD for 500 steps at a predicted 1.42x, 0.47x FP16's TTA).
        held = current is not None and current != self.fallback
        need = (1.0 + cfg.step_penalty) * (1.0 - cfg.hysteresis if held else 1.0)
        if choice != self.fallback and cfg.step_penalty > 0 and not speedup >= need:
            choice, reason = self.fallback, (f"step gate: compression predicted {speedup:.3g}x faster "
                                             f"a step than fp16, below {need:.3g}")
        decision = Decision(choice, self.specs[choice], predicted, tuple(errors), reason, ctx.step,
                            info.key, speedup)
        self.decisions[info.key] = decision
        self.history.append(decision)
        if choice != ctx.choice and info.rank == 0:
            log.info("hvd_gradcomp auto: tensor %s: %s -> %s at step %d (%s; predicted %.3g ms "
                     "against %.3g ms; error %.3g; step speedup %.3g; %d payload bytes against "
                     "fp16's %d)", info.key, self.specs[ctx.choice], self.specs[choice], ctx.step,
                     reason, predicted[choice], predicted[ctx.choice], errors[choice], speedup,
                     wire[choice], wire[self.fallback])
        self._at[info.key] = (ctx.step + 1, choice, n)
        if choice != ctx.choice:  # step 6: carry the old candidate's error feedback over
            pending = None if ctx.probe == "flush" else self.candidates[ctx.choice].residual_of(ops, new, info)
            if carry is not None:
                pending = carry if pending is None else pending + carry
            new = self.candidates[choice].init(ops, info, payload)
            carry = None
            if pending is not None:
                absorbed = self.candidates[choice].add_residual(ops, new, info, pending)
                new, carry = (new, pending) if absorbed is None else (absorbed, None)
        return self._state(ops, payload, ctx.step + 1, choice, new, carry)

    def _synced(self, ops, payload, ctx, state, info, lanes):
        """The state after a sync step (module docstring, *Agreement*): every rank sent its
        gradient plus all it owed in float32 (delivered exactly), and, when every rank
        contributed and none failed, all take rank 0's step and choice (from the lanes), with
        the choice's fresh state; else each keeps its own, and the next step syncs again."""
        n = info.world_size
        if not all(math.isfinite(v) for v in lanes):  # nothing delivered
            return state
        inner = self._flushed(ops, self._inner(state))
        if not _contributors(lanes[0], info, "float32") >= n - 0.5:
            return self._pack(state.step, state.choice, inner, None)
        scale = 1 if info.op == "sum" else n  # rank 0's lanes alone, averaged or not
        step, choice = int(round(lanes[1] * scale)), int(round(lanes[2] * scale))
        if not 0 <= choice < len(self.candidates) or step < 0:
            return self._pack(state.step, state.choice, inner, None)
        if (step, choice) != (ctx.step, ctx.choice) or self._phase(ctx.step)[1]:
            for table in (self._shadows, self._samples, self._firsts, self._pruned, self._infos):
                table.pop(info.key, None)  # this window's figures: not this schedule's
        if (step, choice) != (ctx.step, ctx.choice):
            log.info("hvd_gradcomp auto: tensor %s: realigned to rank 0's schedule (step %d, %s; "
                     "this rank was at step %d, %s)", info.key, step, self.specs[choice], ctx.step,
                     self.specs[ctx.choice])
        self._at[info.key] = (step + 1, choice, n)
        return self._state(ops, payload, step + 1, choice, self.candidates[choice].init(ops, info, payload))

    def _sync_lanes(self, info, step, choice):
        """A sync step's lanes: the count lane, then rank 0's step and choice (0 from the other
        ranks, not pre-scaled: float32 holds them exactly)."""
        mine = [float(step), float(choice)] if info.rank == 0 else [0.0, 0.0]
        return [1.0 / info.world_size] + mine

    @staticmethod
    def _flushed(ops, inner):
        """``inner`` after a flush: its residual (if any) zero."""
        return inner._replace(residual=inner.residual * 0.0) if "residual" in inner._fields else inner

    # ---- measurement ----
    def _measure(self, ops, x, info, step):
        """Run every candidate as a shadow on this rank's gradient (module docstring, step 2).

        A candidate whose first (untimed) window step, with its ring all-reduce ms, came to
        more than :data:`PRUNE_FACTOR` times the fastest such figure among fp16 and the
        candidates whose first-step error was within the budget (and took more than
        :data:`PRUNE_MIN_MS`) is not run again in this window: it would cost its codec on every
        window step (THC on digits' 4M-coordinate weight: 60-100 ms a step) and could win
        only if every faster candidate then failed the budget, which the next window checks. Its lanes then
        say so (:data:`UNUSABLE`), the same way on every rank after the all-reduce. The time
        spent here is taken off the step's measured time (the step gate's input).
        """
        key = info.key
        began = time.perf_counter()
        alone = dataclasses.replace(info, world_size=1, rank=0, op="sum", group=None, dtype="float32")
        shadows = self._shadows.get(key)
        first = shadows is None
        if first:
            shadows = self._shadows[key] = [c.init(ops, alone, x) for c in self.candidates]
            self._samples[key] = [([], []) for _ in self.candidates]
            self._firsts[key] = [(math.nan, math.nan)] * len(self.candidates)
            self._pruned[key] = self._hopeless(info)
            self._infos[key] = info
        pruned = self._pruned[key]
        flat = ops.reshape(x, (info.numel,))
        for i, cand in enumerate(self.candidates):
            if i in pruned:
                continue
            before = cand.residual_of(ops, shadows[i], alone)
            out, shadows[i], elapsed = _alone_step(cand, ops, x, shadows[i], alone)
            corrected = flat if before is None else flat + before
            diff = corrected - out
            num, den = ops.to_host(ops.concat([ops.reshape(ops.sum(diff * diff, None), (1,)),
                                               ops.reshape(ops.sum(corrected * corrected, None), (1,))], 0))
            if not (math.isfinite(num) and math.isfinite(den)):
                continue  # a non-finite gradient on this rank: no figure (step 2)
            if first:  # one-time costs and empty agreed stats: not a sample, only a screen
                self._firsts[key][i] = (elapsed, math.sqrt(num / den) if den > 0 else 0.0)
            else:
                times, errors = self._samples[key][i]
                times.append(elapsed)
                errors.append(math.sqrt(num / den) if den > 0 else 0.0)
        if first:
            f, budget = self.fallback, self.config.error_budget
            current = self._at.get(key, (0, f))[1]  # its real step runs anyway: never pruned
            screened = [ms + 1000.0 * self._comm(info, i) for i, (ms, _) in enumerate(self._firsts[key])]
            admissible = [p for i, (p, (_, e)) in enumerate(zip(screened, self._firsts[key]))
                          if math.isfinite(p) and (i == f or e <= budget)]
            best = min(admissible) if admissible else math.inf
            pruned.update(i for i, (p, (ms, _)) in enumerate(zip(screened, self._firsts[key]))
                          if i not in (f, current) and p > PRUNE_FACTOR * best and ms > PRUNE_MIN_MS)
        self._clock[step][1] += time.perf_counter() - began

    def _hopeless(self, info) -> set:
        """Candidates not even screened for ``info``: with the start costs measured
        (``calibrate()``), a candidate whose codec ms on the reference matrix, scaled to this
        tensor's size, plus its all-reduce ms, exceeds :data:`PRUNE_FACTOR` times that figure of
        the tensor's current choice (and :data:`PRUNE_MIN_MS`). Agreed facts only. THC's first
        call on digits' 4M-coordinate weight was the largest part of the window's first step
        (0.13-0.55 s); its figure there is about 10x PowerSGD's."""
        if self.start_costs is None:
            return set()
        scale = info.numel / math.prod(REFERENCE_SHAPE)
        guess = [ms * scale + 1000.0 * self._comm(info, i) for i, ms in enumerate(self.start_costs)]
        current = self._at.get(info.key, (0, self.fallback))[1]
        return {i for i, g in enumerate(guess) if i not in (self.fallback, current)
                and g > PRUNE_FACTOR * guess[current] and self.start_costs[i] * scale > PRUNE_MIN_MS}

    def _comm(self, info, i):
        """Predicted ring all-reduce seconds of candidate ``i``'s wire bytes for ``info``."""
        cand = self.candidates[i]
        return self.link.seconds(cand.wire(info).payload, info.world_size, cand.payload_dtype(info))

    def _dtypes(self, info):
        return [c.payload_dtype(info) for c in self.candidates]

    def _local(self, key):
        """This rank's window figures for ``key``: (codec ms, errors) per candidate; the
        screen's until a sample exists, :data:`UNUSABLE` when pruned, NaN with neither."""
        samples = self._samples.get(key) or [([], []) for _ in self.candidates]
        firsts = self._firsts.get(key) or [(math.nan, math.nan)] * len(self.candidates)
        pruned = self._pruned.get(key, set())
        times, errors = [], []
        for i, ((t, e), (ms0, e0)) in enumerate(zip(samples, firsts)):
            if i in pruned:
                times.append(UNUSABLE)
                errors.append(UNUSABLE)
            else:  # the screen's figures only until a sample exists (the gate's early reads);
                # none at all (this rank's window gradients were not finite): NaN, so that the
                # probe decides nothing
                times.append(min(min(t) if t else ms0, LANE_MAX))
                errors.append(min(sum(e) / len(e) if e else e0, LANE_MAX))
        return times, errors

    def _round(self, step):
        """This rank's step lanes for the probe ``step`` (module docstring, steps 4-5):
        ``[speedup, step ms]`` and, of the tensor with the most predicted fp16 time (the
        model's leading tensor), per candidate its predicted ms, its error and a 1 for its
        current choice (0 at its first decision); computed once per probe step from the
        window's measurements so far."""
        if self._gate[0] == step:
            return self._gate[1]
        cfg = self.config
        periods = []
        for s in range(max(0, step - cfg.warmup + 1), step):
            if s in self._clock and s + 1 in self._clock:
                t0, shadows = self._clock[s]
                periods.append(self._clock[s + 1][0] - t0 - shadows)
        for s in [s for s in self._clock if s < step - cfg.warmup]:
            del self._clock[s]
        cands = len(self.candidates)
        period = 1000.0 * min(periods) if periods else 0.0
        now = mix = fp16 = 0.0
        lead = (None, None)
        for key, info in self._infos.items():
            times, errors = self._local(key)
            wire = [c.wire(info).payload for c in self.candidates]
            at, current = self._at.get(key, (0, self.fallback, 0))[:2]
            best, predicted, _ = decide(times, errors, wire, info.world_size, self.link,
                                        None if at == cfg.warmup - 1 else current,
                                        self.fallback, cfg.error_budget, cfg.hysteresis,
                                        self._dtypes(info))
            now, mix, fp16 = now + predicted[current], mix + predicted[best], fp16 + predicted[self.fallback]
            size = (self._comm(info, self.fallback), key)  # static facts: the same leader everywhere
            if lead[1] is None or size > lead[0]:
                held = [float(i == current) for i in range(cands)] if at != cfg.warmup - 1 else [0.0] * cands
                lead = (size, list(predicted) + list(errors) + held)
        leader = lead[1] or [UNUSABLE] * (2 * cands) + [0.0] * cands
        if periods:
            rest = max(period - now, 0.0)  # compute and everything else of the step
            speedup = (rest + fp16) / max(rest + mix, 1e-6)
        else:
            speedup = LANE_MAX  # nothing measured: no gate
        self._gate = (step, [min(speedup, LANE_MAX), min(period, LANE_MAX)] +
                      [min(v, LANE_MAX) for v in leader])
        return self._gate[1]

    def _lanes(self, info, step):
        """``[1, codec ms per candidate, error per candidate, speedup, step ms, the leading
        tensor's figures] / world_size`` of this rank's window, each clamped to
        :data:`LANE_MAX` first (module docstring, step 3)."""
        times, errors = self._local(info.key)
        scale = 1.0 / info.world_size
        return [scale * v for v in [1.0] + times + errors + self._round(step)]

    # ---- facts ----
    def wire(self, info: TensorInfo) -> WireBytes:
        """The current choice's bytes and its count lane (a probe step adds ``2 + 5 C`` lane
        values more, or sends float32 instead, as a sync step does; neither is counted here)."""
        cand = self.candidates[self._at.get(info.key, (0, self.fallback))[1]]
        own = cand.wire(info)
        return own._replace(payload=own.payload + itemsize(cand.payload_dtype(info)))

    def metrics(self, state) -> dict:
        return {"choice": state.choice, "step": state.step}

    def history_records(self) -> list:
        """Every decision so far as plain dicts, oldest first: ``key``, ``step`` (the probe
        step), ``scheme`` (the spec chosen), ``reason``, ``speedup`` (the step gate's), and per
        candidate spec its ``predicted_ms`` and ``errors`` (JSON-ready; NaN/inf as None)."""
        def num(v):
            return v if math.isfinite(v) else None
        return [{"key": d.key, "step": d.step, "scheme": d.spec, "reason": d.reason,
                 "speedup": num(d.speedup),
                 "predicted_ms": {s: num(v) for s, v in zip(self.specs, d.predicted_ms)},
                 "errors": {s: num(v) for s, v in zip(self.specs, d.errors)}} for d in self.history]

    def explain(self, key) -> dict:
        """Host facts of ``key``'s last decision: scheme, predicted ms, error, reason, the step
        gate's speedup and the step penalty it was held to (fixed by the option; not learned);
        bytes saved against fp16 per step are added by the adapter (``metrics()``); {} before
        one."""
        d = self.decisions.get(key)
        if d is None:
            at = self._at.get(key)
            return {} if at is None else {"scheme": self.specs[at[1]]}
        return {"scheme": d.spec, "predicted_ms": d.predicted_ms[d.choice],
                "fp16_predicted_ms": d.predicted_ms[self.fallback], "error": d.errors[d.choice],
                "reason": d.reason, "decided_at": d.step, "speedup": d.speedup,
                "step_penalty": self.config.step_penalty}
