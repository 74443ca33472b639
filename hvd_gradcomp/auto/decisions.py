"""``auto``'s pure decisions: the link model, the start candidate and the choice per tensor.

No framework and no tensors: functions of the figures every rank holds alike (the ranks' mean
codec ms and errors from the probe lanes, the calibrated :class:`Link`), so that every rank
decides the same and the rules are unit-tested alone (:mod:`hvd_gradcomp.auto` for the whole
scheme, docs/auto.md for the method and its measurements).
"""
import math
from typing import NamedTuple

from ..base import FALLBACK  # noqa: F401 (re-exported: the fallback candidate, the routing's too)
from ..ring import ring_allreduce_seconds

__all__ = ["Link", "Decision", "decide", "start_choice", "DEFAULT_CANDIDATES", "FALLBACK", "CALIBRATIONS", "UNUSABLE", "LANE_MAX"]

# fp16 first (the fallback), then one setting of each family that trained as well as FP16 on
# digits (docs/bench.md). Every candidate costs its codec once more on each window step (eager
# THC alone was about 0.3 s a step on digits' 4.35M parameters), so the default list is short;
# widen it (e.g. "fp16|topkc:0.1|topkc:0.03|thc:2|thc:4|thc:8|powersgd:1|powersgd:4") for long
# runs, where windows are rare.
DEFAULT_CANDIDATES = "fp16|topkc:0.1|thc:4|powersgd:4"


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
    """The candidate a tensor starts on (docs/auto.md, step 1).

    Args:
        wire_bytes: per candidate, this tensor's payload bytes; ``math.inf`` for a candidate
            that does not accept the tensor (``Scheme.accepts``): never the start.
        reference_bytes: per candidate, the payload bytes of a :data:`REFERENCE_SHAPE` matrix
            (``math.inf`` where it does not accept that matrix).
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
    lossy = [i for i in range(len(wire_bytes)) if i != fallback and math.isfinite(wire_bytes[i])]
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
        wire_bytes: per candidate, payload bytes each rank hands to the all-reduce;
            ``math.inf`` for a candidate that does not accept the tensor (never chosen).
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
        total = ms + 1000.0 * link.seconds(nbytes, world_size, dtype) if math.isfinite(nbytes) else math.inf
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
