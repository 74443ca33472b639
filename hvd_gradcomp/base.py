"""The lifecycle every compression scheme keeps (framework-neutral), and the rules around it.

A *scheme* is the math of one compressor, written once against :class:`~.primitives.Primitives`.
One training step of one tensor is::

    payload, ctx = compress_tensor(scheme, ops, grad, state, info)   # this rank only
    reduced = <Horovod all-reduces payload across the ranks>          # the one collective
    out, state = finish_tensor(scheme, ops, reduced, ctx, state, info)
    # = receive, then decompress and finish on the ctx that receive returned

The lifecycle (methods of :class:`Scheme`):

- ``init(ops, info, like) -> State``: the per-tensor state (a ``NamedTuple`` of tensors, or
  :class:`EmptyState`), created on ``like``'s device.
- ``compress(ops, x, state, info, finite) -> (payload, ctx)``: ``x`` is the gradient as a
  float32 tensor of ``info.shape``; ``finite`` is a bool 0-d tensor, False when ``x`` holds a
  NaN/inf (None for schemes with ``guards_nonfinite = False``). ``payload`` is the one tensor
  Horovod all-reduces; ``ctx`` is whatever ``decompress`` and ``finish`` need (tensors or
  Python values), including the state this step would leave behind. **compress posts no
  collective and waits on no other rank**, so a step cannot hang when ranks call it in
  different orders, for different tensors, or not at all. What ranks must agree on (TopKC's
  chunk ranking, THC's ranges, PowerSGD's shared factor) is computed from data every rank
  already holds: the previous step's all-reduced payload, kept in the state by ``finish``,
  and functions of (seed, tensor key). Only the papers' two-round variants post a side
  collective; they set ``blocking = True``.
- ``receive(ops, payload, ctx, info) -> ctx``: what both ``decompress`` and ``finish`` read
  from the all-reduced payload (the ranks' agreement check, whether the payload is finite),
  computed once and added to ``ctx``; default: ``ctx`` unchanged. Posts no collective.
- ``decompress(ops, payload, ctx, info) -> float32 tensor of info.shape``: the all-reduced
  payload mapped back. Under ``op=Sum`` it is the sum of the ranks' decoded contributions,
  under ``op=Average`` their mean.
- ``finish(ops, payload, ctx, state, info) -> State``: the state after the step, from the
  all-reduced payload and ``ctx`` (``state`` itself when nothing changes). If the all-reduced
  payload says the step failed (some rank's gradient was not finite, which every rank sees
  in the same payload), the state stays exactly as it was, on every rank (``adaptive``
  schemes' call counter ``step`` aside: auto's schedule counts calls, the same on every rank).
- ``wire(info) -> WireBytes``: bytes this tensor puts on the wire per step; a function of
  (shape, dtype, config, world size) only, never of values.

Flags (class attributes of :class:`Scheme`, with their defaults):

- ``guards_nonfinite`` (True): compress receives ``finite`` and must make the payload carry a
  NaN/inf on one rank to every rank's output (:func:`poison` for float payloads). Plain casts
  set it False: NaN/inf survive the cast and the sum on their own. THC sets it False too: it
  sees every NaN/inf in its per-block ranges and flags the rank in its payload itself.
- ``identity`` (False): the adapters hand the tensor to Horovod untouched (``none``; not
  ``none:dtype=float32``, a cast, which is ``linear``).
- ``linear`` (False): the payload is a linear function of the gradient, in a float dtype,
  with no selection agreed between ranks, so Horovod's prescale/postscale factors,
  ``Min``/``Max`` and ``Adasum`` keep their meaning (the casts). Other schemes accept only
  ``Sum``/``Average`` with no scaling; the adapters refuse the rest before any collective.
- ``scalable`` (True): Horovod may multiply the payload by prescale/postscale factors
  (``gradient_predivide_factor``); the decoded result is then scaled the same way. Integer
  payloads (THC) set it False and the adapters refuse any factor other than 1.
- ``blocking`` (False): compress posts a synchronous side collective (``ops.allreduce``).
- ``rank_local_fields`` (``("residual",)``): the state fields that differ between ranks; the
  adapters reset them when a checkpoint is loaded on another number of ranks.
- ``residual_fields`` (``("residual",)``): the state fields that hold the error feedback, all
  zero when nothing is owed (signSGD: ``p`` and ``S``); a state with none of them, or with them
  empty, keeps none (:func:`saturate_output`), and ``auto``'s flush zeroes them.
- ``adaptive`` (False): ``wire(info)`` and the state's fields may change between steps
  (``auto``), so the adapters ask for the bytes at every compress and store whatever
  ``finish`` returns.
- ``flattens`` (False): the math is over the tensor's flat vector (no use of its shape), so a
  bucket's tensors of this scheme may be compressed as one vector of their concatenated
  coordinates (:mod:`~hvd_gradcomp.buckets`): the casts, TopK, TopKC (not EF21, which keeps
  per-tensor estimates), THC, signSGD. Not PowerSGD (matrices: batched per shape instead,
  :mod:`~hvd_gradcomp.powersgd_batched`) or ``auto`` (adaptive: its tensors on one flattening
  choice are grouped between windows by :mod:`~hvd_gradcomp.auto.group`).

What composites (``auto``, the FP16 warm-up), checkpoints and reports need beyond the
lifecycle (error feedback in the gradient's coordinates, the payload dtype, the state a loaded
checkpoint must match, ...) is an optional protocol with defaults: :mod:`hvd_gradcomp.composite`.
The adapters (``torch_backend``, ``tf_backend``) own the state map, the tensor identity and
everything framework-specific; :func:`compress_tensor` and :func:`finish_tensor` hold the
rules every scheme shares (dtype handling, non-finite input).

Which tensors a scheme gets is decided once per tensor by the routing
(:mod:`~hvd_gradcomp.routing`), not by the scheme. A scheme states what it can take once, in
``accepts(info)`` (default: every float tensor; PowerSGD: the matrices it can shrink at its
rank); the routing sends the tensors it does not accept to ``fallback_spec`` (default
:data:`FALLBACK`), as it sends tensors below the class attribute ``min_numel`` (default 1: no
size routing) that no rule names. Neither appears in the scheme's methods: ``compress`` never
sees a tensor ``accepts`` refused.
"""
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import composite
from .primitives import FLOAT_DTYPES

__all__ = ["EmptyState", "TensorInfo", "WireBytes", "StepBytes", "Scheme", "compress_tensor", "finish_tensor",
           "poison", "saturating_cast", "payload_finite", "commit", "passes_through", "check_state",
           "FP16_MAX", "HALF_MAX", "saturate_output", "FALLBACK"]

# The scheme of the tensors a routing does not compress: below ``min_numel``, or refused by
# the chosen scheme's ``accepts``; ``auto``'s fallback candidate too (pre-scaled fp16, cast.py).
FALLBACK = "fp16"

# Largest finite float16: float payloads saturate here instead of overflowing to inf.
FP16_MAX = 65504.0
# Largest finite value of each half-precision gradient dtype: decoded outputs saturate there
# (finish_tensor), the excess kept in error feedback.
HALF_MAX = {"float16": FP16_MAX, "bfloat16": 3.3895313892515355e38}


class EmptyState(NamedTuple):
    """State of a stateless scheme (no fields)."""


@dataclass(frozen=True)
class TensorInfo:
    """What a scheme may know about the tensor it compresses.

    Attributes:
        key: stable identity of the tensor across steps, identical on every rank.
        shape: static shape of the gradient (tuple of ints).
        dtype: dtype string of the gradient (one of FLOAT_DTYPES).
        world_size: number of ranks in the all-reduce (>= 1): the size of the process set
            Horovod reduces this tensor in.
        rank: this process's rank in that process set, in [0, world_size).
        op: the reduction Horovod applies to the payload, ``"sum"`` or ``"average"``, when the
            adapter knows it (a call from Horovod's optimizers or ``hvd.allreduce``); None when
            unknown (``compress(tensor, name=...)`` called by hand). Schemes whose decoding
            depends on it recover it from the payload when None.
        group: the framework's process-set object for blocking side collectives (None for the
            global set); not part of the tensor's identity.
        nccl_avg: True when the all-reduce multiplies each rank's payload by 1/world_size
            itself, in the payload's dtype, before summing: Horovod's NCCL all-reduce under
            ``op=Average`` (``ncclAvg``, NCCL >= 2.10; decided by the adapter,
            :func:`hvd_gradcomp.adapter.horovod_nccl_avg`). Schemes then skip their own 1/n
            pre-scale of float payloads (:attr:`prescale`): with both, a float16 payload would
            travel as x/n^2 and flush to zero at large n. Only meaningful with op "average".
    """

    key: str
    shape: tuple
    dtype: str
    world_size: int
    rank: int
    op: Any = None
    group: Any = field(default=None, compare=False, hash=False)
    nccl_avg: bool = False

    @property
    def backend_divides(self) -> bool:
        """True when the all-reduce pre-multiplies payloads by 1/n (``nccl_avg`` under Average)."""
        return self.nccl_avg and self.op == "average" and self.world_size > 1

    @property
    def prescale(self) -> float:
        """The factor schemes multiply a float payload by before the all-reduce: 1/world_size
        (so n ranks' float16 sum stays in range), or 1.0 where the all-reduce divides by n
        before summing (:attr:`backend_divides`). Decoding multiplies by :attr:`unscale`."""
        return 1.0 if self.backend_divides else 1.0 / self.world_size

    @property
    def unscale(self) -> float:
        """``1 / prescale``: the factor a decoded float payload is multiplied by (world_size,
        or 1.0 where the all-reduce divided by n itself); right under Sum and Average alike."""
        return 1.0 if self.backend_divides else float(self.world_size)

    @property
    def fp16_limit(self) -> float:
        """The largest |value| a rank may put in a pre-scaled float16 payload so that the
        all-reduce of every rank's payload stays finite: 65504/n rounded down to float16; where
        the all-reduce multiplies by s = float16(1/n) first (:attr:`backend_divides`), the
        largest value whose product with s stays within that bound."""
        limit = fp16_floor(FP16_MAX / self.world_size)
        if self.backend_divides:
            limit = fp16_floor(min(FP16_MAX, limit / fp16_round(1.0 / self.world_size)))
        return limit

    @property
    def numel(self) -> int:
        """Number of coordinates d = prod(shape) (1 for a 0-d tensor)."""
        n = 1
        for s in self.shape:
            n *= s
        return n


class WireBytes(NamedTuple):
    """Bytes one tensor puts on the wire per step (per rank, as handed to the all-reduces).

    payload: bytes of the payload tensor Horovod all-reduces.
    side: bytes of all side collectives issued inside compress (blocking variants only).
    side_collectives: how many side collectives compress issues (each costs a latency).
    """

    payload: int
    side: int = 0
    side_collectives: int = 0

    @property
    def total(self) -> int:
        return self.payload + self.side


class StepBytes(NamedTuple):
    """Bytes one rank hands to Horovod per step, over all tensors a compressor has seen.

    payload, side, side_collectives: :class:`WireBytes` summed over the compressed tensors.
    sparse: bytes of the sparse gradients Horovod gathers on its sparse path (PyTorch
        ``sparse=True`` embeddings, TensorFlow ``IndexedSlices``): this rank's indices and
        values, as of the last step each was seen (their size varies with the batch).
    sparse_collectives: gathers of those gradients per step (2 each: indices, values).
    """

    payload: int
    side: int = 0
    side_collectives: int = 0
    sparse: int = 0
    sparse_collectives: int = 0

    @property
    def total(self) -> int:
        """All bytes: payload + side + sparse."""
        return self.payload + self.side + self.sparse


class Scheme:
    """Base class of the framework-neutral schemes: the lifecycle and flags of the module
    docstring.

    Subclasses set ``name`` and ``config`` and implement ``compress``/``decompress``/``wire``;
    the default ``init`` returns :class:`EmptyState`, ``receive`` keeps the ctx and ``finish``
    the state. Optional hooks for composites and checkpoints: :mod:`hvd_gradcomp.composite`.
    """

    name = "scheme"
    config: Any = None
    # The flags of the module docstring, with their defaults.
    guards_nonfinite = True
    identity = False
    linear = False
    scalable = True
    blocking = False
    # State fields that differ between ranks (this rank's error feedback); every other field
    # is equal on all ranks (agreed ranges, scores, bases, counters). A checkpoint loaded on a
    # different number of ranks keeps the others and resets these to zero.
    rank_local_fields = ("residual",)
    # State fields that hold the error feedback (all zero: nothing owed); the default
    # composite.residual_of reads ``residual``, a scheme with others overrides it.
    residual_fields = ("residual",)
    # True: the scheme also works without its state (EmptyState), which the adapters then hand
    # it for a tensor they cannot name (fp16: its agreed scale, module cast.py); False: such a
    # tensor is refused when the scheme keeps state.
    state_optional = False
    adaptive = False
    flattens = False
    # Routing (module docstring): tensors no rule names with fewer coordinates go to the
    # fallback when this scheme is the default (a compressor's ``min_numel`` overrides it);
    # the scheme spec that sends the tensors ``accepts`` refuses.
    min_numel = 1
    fallback_spec = FALLBACK

    def spec(self) -> str:
        """The text spec that rebuilds this scheme, e.g. ``"topkc:ratio=0.01,chunk=256"``."""
        from .options import to_spec
        return to_spec(self)

    def init(self, ops, info: TensorInfo, like):
        return EmptyState()

    def compress(self, ops, x, state, info: TensorInfo, finite):
        raise NotImplementedError(f"{type(self).__name__}.compress")

    def receive(self, ops, payload, ctx, info: TensorInfo):
        """``ctx`` with what decompress and finish both read from the all-reduced
        ``payload`` (module docstring); default: ``ctx`` unchanged."""
        return ctx

    def decompress(self, ops, payload, ctx, info: TensorInfo):
        raise NotImplementedError(f"{type(self).__name__}.decompress")

    def finish(self, ops, payload, ctx, state, info: TensorInfo):
        """The state after this step (module docstring); default: unchanged."""
        return state

    def wire(self, info: TensorInfo) -> WireBytes:
        raise NotImplementedError(f"{type(self).__name__}.wire")

    def accepts(self, info: TensorInfo) -> bool:
        """True if this scheme compresses the tensor ``info`` describes; the routing sends
        the others to :attr:`fallback_spec`, and ``auto`` never chooses a candidate that refuses
        one. A function of ``info.shape``, ``info.dtype`` and what :meth:`bind` recorded only
        (asked once per tensor, also by ``route()`` before training, where the world size
        is 1). Default: True."""
        return True

    def bind(self, ops):
        """Called once by the adapter with its backend's primitives, before any other method
        (for facts ``wire`` needs and gets no ``ops`` for, e.g. a kernel layout); returns self."""
        return self

    def __repr__(self):
        return f"<{type(self).__name__} {self.spec()}>"


def passes_through(dtype: str, numel: int) -> bool:
    """True for tensors every compressor hands to Horovod untouched: non-float or empty."""
    return dtype not in FLOAT_DTYPES or numel == 0


def check_state(state, expected, key: str):
    """Raise ValueError unless ``state`` has the fields of ``expected`` (shapes: the adapter).

    Both are NamedTuples of tensors; ``expected`` is a freshly initialised state. Used when a
    state is loaded (:mod:`hvd_gradcomp.records`), so a wrong checkpoint is refused on every
    rank before any collective is posted.
    """
    if tuple(state._fields) != tuple(expected._fields):
        raise ValueError(f"state for tensor {key!r}: expected fields {list(expected._fields)} "
                         f"({type(expected).__name__}), got {list(state._fields)}")


def poison(ops, payload, finite):
    """Make a float payload NaN everywhere when ``finite`` (bool 0-d tensor) is False.

    After the all-reduce every rank's output is then non-finite, so a loss scaler skips the
    step on all ranks together (a NaN on one rank alone would desynchronise them), and every
    rank's ``finish`` sees the failed step in the same payload.
    """
    if finite is None:
        return payload
    return payload + ops.cast(ops.where(finite, 0.0, float("nan")), ops.dtype(payload))


def fp16_floor(value: float) -> float:
    """The largest float16 value <= ``value`` (host side; ``value`` in (0, 65504])."""
    import struct
    bits = struct.unpack("<H", struct.pack("<e", value))[0]
    while struct.unpack("<e", struct.pack("<H", bits))[0] > value:
        bits -= 1
    return struct.unpack("<e", struct.pack("<H", bits))[0]


def fp16_round(value: float) -> float:
    """``value`` rounded to the nearest float16 (host side), as a device rounds a constant."""
    import struct
    return struct.unpack("<e", struct.pack("<e", value))[0]


def saturating_cast(ops, x, dtype: str, ranks: int = 1, limit: float = None):
    """``x`` (float32) cast to a float payload dtype, finite values clamped so that the sum of
    ``ranks`` such payloads stays finite.

    A finite gradient above float16's range must not become inf on the wire: each rank's
    value is clamped at the largest float16 <= 65504 / ranks (a sum of ``ranks`` of them,
    rounded to float16 at each addition, stays <= 65504), or at ``limit`` when given
    (:attr:`TensorInfo.fp16_limit`, which also knows whether the all-reduce divides by n
    first), and the rest stays in the sender's error feedback (its residual is
    ``x - decoded(payload)``). NaN stays NaN (a failed step must still be seen as one).
    """
    if dtype == "float16":
        limit = fp16_floor(FP16_MAX / ranks) if limit is None else limit
        x = ops.minimum(ops.maximum(x, -limit), limit)
    return ops.cast(x, dtype) if dtype != "float32" else x


def payload_finite(ops, payload):
    """bool 0-d: the all-reduced float payload holds no NaN/inf (one float32 sum)."""
    return ops.isfinite(ops.sum(ops.cast(payload, "float32"), None))


def commit(ops, ok, new, old):
    """``new`` (a state NamedTuple) if the bool 0-d ``ok`` holds, else ``old`` (``ops.select``:
    no pass over the fields where the backend can read ``ok`` for free)."""
    return ops.select(ok, lambda: new, lambda: old)


def compress_tensor(scheme: Scheme, ops, tensor, state, info: TensorInfo):
    """Shared compress rules around ``scheme.compress``; returns ``(payload, ctx)``.

    1. The gradient is viewed in float32 (fp16/bf16/fp64 inputs are cast; fp64 loses precision
       beyond float32, which every payload here has anyway).
    2. ``finite``: one float32 sum, non-finite iff some coordinate is NaN/inf (or the finite
       values sum beyond 3.4e38, which is treated as non-finite too). 4M coordinates: 0.3 ms
       against 13 ms for all(isfinite).
    3. ``scheme.compress`` runs; it posts no collective (unless the scheme is ``blocking``).
    """
    x = ops.cast(tensor, "float32") if info.dtype != "float32" else tensor
    finite = ops.isfinite(ops.sum(x, None)) if scheme.guards_nonfinite else None
    return scheme.compress(ops, x, state, info, finite)


def finish_tensor(scheme: Scheme, ops, payload, ctx, state, info: TensorInfo, dtype=None, scale=None,
                  factor=1.0, into=None):
    """The rest of the step once Horovod has all-reduced ``payload``: ``(out, new_state)``.

    ``out`` is ``scheme.decompress`` times ``factor`` (a Python float: an engine's ``1 / n``)
    in the gradient's shape and ``dtype`` (default ``info.dtype``), times ``scale`` (a loss
    scale: a 0-d float32 tensor, or None) when given; with a float32 ``dtype`` and no ``scale``
    it may be written into ``into`` (:func:`~hvd_gradcomp.composite.decompress_into`);
    ``new_state`` is ``scheme.finish`` (the state stays as it was when the all-reduced payload
    says a rank failed); both get the ctx of ``scheme.receive``. Used by the adapters, the
    overhead benchmark and the tests alike.

    Half-precision gradients (``dtype`` float16 or bfloat16): a finite decoded value beyond
    the dtype's largest finite one would become inf in the cast (each rank's payload is capped
    at 65504 / n, so a sum of n of them, or a residual owed for many steps, may exceed 65504).
    :func:`saturate_output` clamps it there and returns the excess to the ranks' error
    feedback (:func:`~hvd_gradcomp.composite.add_residual`), so the state commits only what
    was delivered.
    A scheme that keeps no error feedback (fp16, bf16, ``error_feedback=False``) is not
    clamped: its overflow is the sum's own, as in an uncompressed all-reduce.
    """
    dtype = dtype or info.dtype
    into = into if dtype == "float32" and scale is None else None  # (nothing else may follow the write)
    ctx = scheme.receive(ops, payload, ctx, info)
    out = composite.decompress_into(scheme, ops, payload, ctx, info, factor, into)
    out = ops.reshape(out, info.shape)
    new_state = scheme.finish(ops, payload, ctx, state, info)
    if dtype in HALF_MAX:
        out, new_state = saturate_output(scheme, ops, out, new_state, info, HALF_MAX[dtype], scale)
    if scale is not None:
        out = out * scale
    if dtype != "float32":
        out = ops.cast(out, dtype)
    return out, new_state


def saturate_output(scheme: Scheme, ops, out, state, info: TensorInfo, limit: float, scale=None, keep=None):
    """``(out, state)`` with ``out``'s finite values clamped to ``[-limit, limit]`` (divided by
    ``scale`` when given: ``out`` is in unscaled units) and the excess added to this rank's
    error feedback in ``state``.

    ``out``: float32 of ``info.shape``, the decoded sum (``info.op == "sum"``) or mean (any
    other op; Horovod's default is Average) of the ranks' contributions. Every rank sees the
    same ``out``, so each keeps an equal share of the excess: ``excess / world_size`` under
    Sum, ``excess`` under Average (the mean of the ranks' residuals is then the undelivered
    mean); the ranks' outputs plus their pending error feedback still sum to their gradients.
    ``keep`` (a number): this rank keeps ``keep`` times the excess instead, because it alone
    decodes ``out`` (a reduce-scatter's destination keeps all of it: the mean's excess times
    the divisor).
    NaN/inf stay as they are (a failed step must be seen as one; its excess is 0). Unchanged
    when the state keeps no error feedback (its ``Scheme.residual_fields`` missing or empty; for
    ``adaptive`` schemes: :func:`~hvd_gradcomp.composite.add_residual` returns None). No host read for
    fixed schemes: ``ops.select`` on whether any value was clamped.
    """
    lim = limit if scale is None else limit / scale
    clamped = ops.minimum(ops.maximum(out, -lim), lim)
    excess = ops.where(ops.isfinite(out), out - clamped, 0.0 * out)
    if keep is not None:
        share = excess * keep if keep != 1.0 else excess
    else:
        share = excess if info.op != "sum" else excess * (1.0 / info.world_size)
    flat = ops.reshape(share, (info.numel,))
    if scheme.adaptive:  # its state's fields may change (auto's carry): it decides itself
        kept = composite.add_residual(scheme, ops, state, info, flat)
    else:
        held = [getattr(state, f, None) for f in scheme.residual_fields]
        if not held or any(r is None or 0 in tuple(ops.shape(r)) for r in held):
            return out, state  # no error feedback to keep the excess in
        clipped = ops.sum(ops.abs(excess), None) > 0.0
        kept = ops.select(clipped, lambda: composite.add_residual(scheme, ops, state, info, flat),
                          lambda: state)
    if kept is None:
        return out, state
    return ops.where(ops.isfinite(out), clamped, out), kept
