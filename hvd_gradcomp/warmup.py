"""FP16 warm-up: the first steps of each tensor go as FP16, then the scheme's own payload.

``fp16_warmup=N`` is an option every compressor spec and factory accepts
(``"topkc:0.1,fp16_warmup=50"``, ``Compression.powersgd(4, fp16_warmup=50)``, a rule's
scheme ``"*.weight -> thc:fp16_warmup=20"``); :func:`hvd_gradcomp.registry.make_scheme`
wraps the scheme in :class:`WarmupScheme` when N > 0 (it changes nothing for ``fp16`` and
``none``, and ``auto``, which starts on FP16 and decides itself, refuses it). Why: lossy
compression costs most at the start of training, when gradients are large and change fast
(Adam's second moment is being formed; PowerSGD's basis and TopKC's scores know nothing yet);
recipes start on FP16 for a while (PowerSGD's ``start_powerSGD_iter``, ZeRO++/1-bit Adam's
warm-up). Counted inside the compressor, per tensor, from the tensor's first step.

Per tensor and step, with ``t`` the warm-up steps this rank has completed (the state's
``warmup`` field; ``-1`` once handed over), world size ``n``:

1. ``t >= 0`` (warm-up): payload ``[x / n as float16 (d values), 1 / n, r / n]`` with
   ``r = 1`` if ``t + 1 >= N`` (this rank is ready to hand over) else 0, all NaN when ``x`` holds a
   NaN/inf (:func:`~hvd_gradcomp.base.poison`); decoded as the ``fp16`` scheme decodes
   (times n: the sum under Sum, the mean under Average). ``t = -1``: the scheme's own
   payload, ctx and state (its ``wire()``, which ``wire_bytes()`` reports, is this one).
2. After the all-reduce, a warm-up step reads its two control values (one host read per
   tensor and warm-up step; none afterwards): ``M`` (the contributing ranks, over n; under
   Average over n again) and ``R`` (the ready ones). All ranks see the same two values, so they
   decide alike: when the payload is finite, every rank of the process set contributed
   (``M`` is ``1`` under Sum, ``1 / n`` under Average; a rank in ``hvd.join()`` contributes
   zeros) and some rank is ready (``R > 0``), every rank hands over: the scheme's state is
   seeded from this last FP16 step (:func:`~hvd_gradcomp.composite.hand_over`: TopKC's
   scores from the aggregate's chunk norms; EF21's ``h_i`` from this rank's decoded gradient
   and ``H`` from the aggregate) and ``t := -1``. Otherwise ``t := t + 1`` (finite payload) or
   ``t`` stays (a failed step).

Why this keeps the payload size agreed (Horovod refuses an all-reduce whose ranks post
different sizes): the size changes once, at a step that every rank of the set took part in
and decided alike from the same payload. A rank in ``hvd.join()`` holds the hand-over back
(the others stay on FP16 until it returns), so a rank back from a join is never left on FP16
while the others compress. Ranks whose counts differ (a checkpoint loaded on one rank during
the warm-up) hand over together when the most advanced one is ready: within one step. What
it cannot see: a state saved *after* the hand-over loaded on some ranks while the others
start afresh (they post different sizes at once, and Horovod raises its shape-mismatch error
on every rank); load a checkpoint on every rank (``state_dict(gather=True)``). When the
reduction is unknown (``compress(tensor, name=...)`` by hand) any contributing set counts as
complete.

Costs: one host read of 3 values per tensor and warm-up step (a device sync on a GPU), none
after the hand-over; TensorFlow must run eagerly during the warm-up (a ``tf.function``
raises ValueError naming the option). bf16 and the linear schemes keep their flags; the
warm-up payload is float16, so a Horovod group of mixed dtypes widens as usual.
"""
from typing import NamedTuple

from . import composite
from .base import Scheme, TensorInfo, WireBytes, payload_finite, poison

__all__ = ["WarmupScheme", "WARMUP_FIELD"]

# The state field that counts the warm-up steps (-1: handed over).
WARMUP_FIELD = "warmup"
# Wrapped state types by inner state type, and back.
_WRAPPED = {}
_INNER = {}


def _wrapped_type(inner_type):
    """A NamedTuple type with ``inner_type``'s fields and ``warmup`` (int64 [])."""
    wrapped = _WRAPPED.get(inner_type)
    if wrapped is None:
        if WARMUP_FIELD in inner_type._fields:
            raise TypeError(f"{inner_type.__name__} already has a field {WARMUP_FIELD!r}")
        wrapped = NamedTuple(f"Warmup{inner_type.__name__}",
                             [(f, object) for f in inner_type._fields + (WARMUP_FIELD,)])
        _WRAPPED[inner_type], _INNER[wrapped] = wrapped, inner_type
    return wrapped


class _WarmupCtx(NamedTuple):
    warm: bool  # a warm-up step (FP16 payload)
    inner: object  # the scheme's ctx (compressed steps)
    half: object  # float16 [d]: this rank's pre-scaled gradient as sent (warm-up steps)


class WarmupScheme(Scheme):
    """``inner`` after ``steps`` FP16 steps of each tensor (module docstring)."""

    guards_nonfinite = True

    def __init__(self, inner: Scheme, steps: int):
        self.inner, self.steps = inner, steps
        self.name, self.config = inner.name, inner.config
        self.linear, self.scalable, self.blocking = inner.linear, inner.scalable, inner.blocking
        self.rank_local_fields = inner.rank_local_fields
        self.flattens = inner.flattens
        self.min_numel, self.fallback_spec = inner.min_numel, inner.fallback_spec  # the routing's
        self._done = {}  # key -> warm-up steps completed (host mirror of the state), -1 after

    def bind(self, ops):
        self.inner = self.inner.bind(ops)
        return self

    def _split(self, state):
        return _INNER[type(state)](*state[:-1]), state[-1]

    def init(self, ops, info: TensorInfo, like):
        inner = self.inner.init(ops, info, like)
        return _wrapped_type(type(inner))(*inner, ops.zeros((), "int64", like))

    def _count(self, ops, state, info):
        t = self._done.get(info.key)
        if t is None:
            if not ops.eager():
                raise ValueError(f"{self.spec()}: fp16_warmup reads each warm-up step's agreement "
                                 f"on the host, which needs eager execution; tensor {info.key!r} is "
                                 f"compressed inside a tf.function (run the first {self.steps} steps "
                                 f"eagerly, or use fp16_warmup=0)")
            t = self._done[info.key] = int(ops.to_host(state[-1]))
        return t

    def compress(self, ops, x, state, info, finite):
        inner_state, _ = self._split(state)
        if self._count(ops, state, info) < 0:
            payload, ctx = self.inner.compress(ops, x, inner_state, info,
                                               finite if self.inner.guards_nonfinite else None)
            return payload, _WarmupCtx(False, ctx, None)
        if not ops.eager():
            raise ValueError(f"{self.spec()}: fp16_warmup needs eager execution during the warm-up "
                             f"(tensor {info.key!r} is compressed inside a tf.function)")
        n = info.world_size
        ready = 1.0 if self._done[info.key] + 1 >= self.steps else 0.0
        # Pre-scaled as the fp16 scheme (1/n, or 1 where the all-reduce divides by n itself).
        half = ops.cast(ops.reshape(x, (info.numel,)) * info.prescale, "float16")
        control = ops.cast(ops.constant([info.prescale, ready * info.prescale], "float32", x), "float16")
        return poison(ops, ops.concat([half, control], 0), finite), _WarmupCtx(True, None, half)

    def receive(self, ops, payload, ctx, info):
        if ctx.warm:
            return ctx
        return ctx._replace(inner=self.inner.receive(ops, payload, ctx.inner, info))

    def decompress(self, ops, payload, ctx, info):
        if ctx.warm:
            return ops.cast(payload[:info.numel], "float32") * info.unscale
        return self.inner.decompress(ops, payload, ctx.inner, info)

    def finish(self, ops, payload, ctx, state, info):
        inner_state, count = self._split(state)
        if not ctx.warm:
            return type(state)(*self.inner.finish(ops, payload, ctx.inner, inner_state, info), count)
        n, d = info.world_size, info.numel
        read = ops.concat([ops.cast(payload[d:], "float32"),
                           ops.reshape(ops.cast(payload_finite(ops, payload), "float32"), (1,))], 0)
        joined, ready, ok = ops.to_host(read)
        if not ok:
            return state
        # The control lane's value when every rank contributed 1 * prescale.
        full = 1.0 if info.backend_divides else {"sum": 1.0, "average": 1.0 / n}.get(info.op)
        complete = joined > full * (1.0 - 0.5 / n) if full is not None else joined > 0
        if complete and ready > 0:
            aggregate = ops.cast(payload[:d], "float32") * info.unscale
            own = ops.cast(ctx.half, "float32") * info.unscale  # decoded at the hand-over only
            inner_state = composite.hand_over(self.inner, ops, inner_state, own, aggregate, info)
            self._done[info.key] = -1
            return type(state)(*inner_state, count * 0 - 1)
        self._done[info.key] += 1
        return type(state)(*inner_state, count * 0 + self._done[info.key])

    def accepts(self, info: TensorInfo) -> bool:
        """The scheme's: a tensor it does not accept goes to its fallback from the first step."""
        return self.inner.accepts(info)

    def wire(self, info: TensorInfo) -> WireBytes:
        """The scheme's bytes after the warm-up (warm-up steps send ``2 (d + 2)``)."""
        return self.inner.wire(info)

    # ---- the composite hooks (hvd_gradcomp.composite): the scheme's, on its part of the state ----
    def carry_over(self, ops, state, olds, info):
        """A new bucket group keeps its tensors' warm-up count (DDP's rebuilt buckets must not
        restart it): the least advanced of the earlier holders' counts, or handed over (-1)
        when all were; one host read per earlier holder without a host mirror, once."""
        counts = []
        for key, old in olds:
            t = self._done.get(key)
            counts.append(int(ops.to_host(old[-1])) if t is None else t)
        running = [t for t in counts if t >= 0]
        t = min(running) if running else -1
        self._done[info.key] = t
        return state._replace(**{WARMUP_FIELD: ops.constant(t, "int64", state[-1])})

    def forget(self, key):
        self._done.pop(key, None)
        composite.forget(self.inner, key)

    def check_loaded(self, key, loaded):
        composite.check_loaded(self.inner, key, loaded)

    def payload_dtype(self, info: TensorInfo) -> str:
        return composite.payload_dtype(self.inner, info)

    def sent_zeros(self, ops, ctx):
        """A warm-up step's FP16 payload is summed whole (its ctx's ``half`` is read only at the
        hand-over, into this rank's own state); a later step's ctx is the scheme's."""
        return ctx if ctx.warm else ctx._replace(inner=composite.sent_zeros(self.inner, ops, ctx.inner))

    def metrics(self, state) -> dict:
        return composite.metrics(self.inner, self._split(state)[0])

    def residual_of(self, ops, state, info):
        return composite.residual_of(self.inner, ops, self._split(state)[0], info)

    def add_residual(self, ops, state, info, residual):
        inner_state, count = self._split(state)
        new = composite.add_residual(self.inner, ops, inner_state, info, residual)
        return None if new is None else type(state)(*new, count)
