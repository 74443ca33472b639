"""PowerSGD batched: a bucket's matrices of one view stacked, multiplied, orthogonalised and checked
as one batch, in one payload, so the operations per step follow the bucket's matrix shapes, not
its matrix count (epfml/powersgd's ``batch_tensors_with_same_shape``; issue 51).

:meth:`Codec.plan_bucket <hvd_gradcomp.codec.Codec.plan_bucket>` forms a *batch unit* of the
tensors of one bucket that the same :class:`~hvd_gradcomp.powersgd.PowerSGDScheme` sends
(``variant="alternating"``, classic or no error feedback) with the same matrix view ``n x m``
(:func:`batch_view`): a group of the bucket (:mod:`hvd_gradcomp.buckets`: a group key, one
flat vector of its members' coordinates in their order, the members' ``B`` matrices' plain
layouts one after the other) compressed by a :class:`BatchedPowerSGD` made for it
(:func:`batched_scheme`). The math is the alternating variant's (docs/powersgd.md, steps 2-10),
each product a batched ``matmul`` over ``[B, ...]``, the projection basis
:func:`~hvd_gradcomp.orthogonalize.basis_rows_batched`, one payload
``[B r max(n, m) + 6]``: the ``B`` travelling factors, then the parities and *one* pair of
basis fingerprints for the batch (the members' fingerprints summed: any member's basis that
differs between ranks changes the sum, and the whole batch realigns, as one matrix would).

Per matrix, nothing changes: each keeps its own error feedback and factors (row ``b`` of the
stacked fields), started from the same shared random fill (keyed by the tensor's own key) as
per-matrix PowerSGD, so a step's output equals per-matrix PowerSGD's within float32 rounding
(tests/core/test_powersgd_batched.py).

State: a :class:`~hvd_gradcomp.powersgd.PowerSGDState` with the fields stacked: ``residual``
``[B, *natural]`` (the group's flat coordinates; ``[0]`` without error feedback), ``p``
``[B, r, n]``, ``q`` ``[B, r, m]``, ``fill`` ``[B, r, K]``, ``step``, ``realigned`` and
``version`` 0-d (the batch steps together). A checkpoint of a bucketed run stores each
member's error feedback under its own key and the other fields under the group key (as every
bucket group: :mod:`hvd_gradcomp.group_checkpoint`). Per-matrix states are converted when the
batch is first sent: a per-matrix checkpoint loaded before the first step (today's main's
format, :meth:`BatchedPowerSGD.init`), or the per-matrix and earlier batches' states a DDP
bucket rebuild leaves (:meth:`BatchedPowerSGD.carry_over`): each member's factors, fill and
error feedback are taken as they were; members whose step parities differ start the batch
realigned (``P^ = 0``, step 0: what a disagreement gives, the same on every rank). A
per-matrix state loaded after the batch already holds its members keeps only its error
feedback (the generic path of :mod:`hvd_gradcomp.checkpoint`).

Not batched (sent per matrix as before): ``variant="two_round"`` (a blocking side collective
per matrix), ``error_feedback="ef21"``, PowerSGD inside the FP16 warm-up or ``auto``, and a
view with one matrix in the bucket.
"""
from .base import Scheme, TensorInfo, WireBytes, commit, poison
from .lowrank import matrix_view, outer_batch, pad_batch, times_left_batch, times_right_batch
from .orthogonalize import DEPENDENT_TOL, basis_rows_batched
from .powersgd import CONTROL, PowerSGDScheme, PowerSGDState, _agree_kernel, _AltCtx

__all__ = ["BatchedPowerSGD", "batch_view", "batched_scheme"]


def batch_view(scheme, info: TensorInfo, layout: str):
    """The matrix view (:class:`~hvd_gradcomp.lowrank.View`) under which ``info``'s tensor may join
    a batch of ``scheme`` (tensors of one bucket with equal views form one), or None: ``scheme``
    is not a plain :class:`~hvd_gradcomp.powersgd.PowerSGDScheme` of the alternating variant
    with classic or no error feedback (module docstring), or does not accept the tensor."""
    if type(scheme) is not PowerSGDScheme or scheme.blocking or scheme.ef21 or not scheme.accepts(info):
        return None
    return matrix_view(info.shape, layout)


def batched_scheme(scheme, gkey: str, keys: tuple, infos: tuple, view, book) -> "BatchedPowerSGD":
    """The :class:`BatchedPowerSGD` of group ``gkey`` of ``scheme`` (made once per group key and
    kept in ``scheme.batches``, where :meth:`BatchedPowerSGD.carry_over` finds earlier batches'
    members); arguments as its constructor's."""
    batch = scheme.batches.get(gkey)
    if batch is None or batch.keys != tuple(keys):
        batch = scheme.batches[gkey] = BatchedPowerSGD(scheme, gkey, keys, infos, view, book)
    return batch


class BatchedPowerSGD(Scheme):
    """The alternating PowerSGD of ``inner`` over a batch of ``B`` matrices of one view (module
    docstring), a scheme of the group's flat vector (``info.shape == (B n m,)``).

    Args:
        inner: the :class:`~hvd_gradcomp.powersgd.PowerSGDScheme` the members are routed to.
        gkey: the group's key (where the codec's store keeps its state).
        keys: the members' tensor keys, in the group's order; infos: their own TensorInfos.
        view: their common :class:`~hvd_gradcomp.lowrank.View`.
        book: the codec's :class:`~hvd_gradcomp.records.TensorBook`, whose loaded per-matrix
            states (``pending``) :meth:`init` adopts.
    """

    name = "powersgd"

    def __init__(self, inner: PowerSGDScheme, gkey, keys, infos, view, book):
        self.inner, self.gkey, self.keys, self.infos, self.view, self.book = \
            inner, gkey, tuple(keys), tuple(infos), view, book
        self.agreed = None  # the last committed state's (p, q, step, fill): row()
        self.stepped = 0  # inner.batch_clock at this batch's last step (the latest holder wins: row())
        self.config = inner.config
        self.rank_local_fields = inner.rank_local_fields
        self.fallback_spec = inner.fallback_spec
        self._weights = None  # (the state's fill, its fingerprint weights [B, 2, r K])

    @property
    def size(self) -> int:
        return len(self.keys)

    def _width(self):
        return max(self.view.n, self.view.m)

    # ---- state ----
    def init(self, ops, info, like):
        """The stacked state of the members: each one's loaded per-matrix state (a checkpoint of
        per-matrix PowerSGD; taken out of the tensor book's ``pending``, checked as the per-matrix
        path checks it: ValueError for another format or shape), else its fresh
        :meth:`PowerSGDScheme.init <hvd_gradcomp.powersgd.PowerSGDScheme.init>` state."""
        states = []
        for key, minfo in zip(self.keys, self.infos):
            loaded = self.book.pending.get(key)
            if loaded is not None and tuple(getattr(loaded, "_fields", ())) == PowerSGDState._fields:
                del self.book.pending[key]
                states.append(self.book.initial_state(self.inner, minfo, like, loaded))
            else:
                states.append(self.inner.init(ops, minfo, like))
        return self._stack(ops, states)

    def _stack(self, ops, states):
        """A batch state from ``B`` per-matrix states (PowerSGDState each); the batch starts
        realigned where their step parities differ (module docstring)."""
        def stacked(field):
            parts = [ops.reshape(getattr(s, field), (1,) + tuple(ops.shape(getattr(s, field)))) for s in states]
            return parts[0] if len(parts) == 1 else ops.concat(parts, 0)
        steps = stacked("step")  # int64 [B]
        parity = ops.bitwise_and(steps, 1)
        mixed = ops.logical_and(ops.max(parity, None) > 0, ops.max(1 - parity, None) > 0)  # both present
        p = stacked("p")
        p = ops.where(mixed, p * 0.0, p)
        step = ops.where(mixed, steps[0] * 0, steps[0])
        realigned = ops.sum(stacked("realigned"), None)
        return PowerSGDState(stacked("residual"), p, stacked("q"), step, stacked("fill"), realigned,
                             states[0].version)

    def carry_over(self, ops, state, olds, info):
        """``state`` (fresh) with each member's fields as the earlier holders left them
        (``olds``: ``[(key, state)]``: a member's per-matrix state, or an earlier batch of it,
        after DDP's bucket rebuild); error feedback moves apart (:mod:`hvd_gradcomp.buckets`)."""
        held = dict(olds)
        none = ops.zeros((0,), "float32", state.q)  # (error feedback is not stacked here)
        states = []
        for j, key in enumerate(self.keys):
            src = self._held(ops, key, held)
            states.append(src if src is not None else PowerSGDState(
                none, state.p[j], state.q[j], state.step, state.fill[j], state.realigned, state.version))
        return self._stack(ops, states)._replace(residual=state.residual)

    def _held(self, ops, key, held):
        """Member ``key``'s per-matrix fields from an earlier holder in ``held``, or None."""
        old = held.get(key)
        if isinstance(old, PowerSGDState) and tuple(ops.shape(old.q)) == (self.config.rank, self.view.m):
            return old._replace(residual=ops.zeros((0,), "float32", old.q))
        for gkey, old in held.items():
            batch = self.inner.batches.get(gkey)
            if batch is not None and key in batch.keys and batch.view == self.view and isinstance(old, PowerSGDState):
                j = batch.keys.index(key)
                return PowerSGDState(ops.zeros((0,), "float32", old.q), old.p[j], old.q[j], old.step, old.fill[j],
                                     old.realigned * 0, old.version)
        return None

    # ---- the step (docs/powersgd.md, alternating steps 2-10, per matrix of the batch) ----
    def compress(self, ops, x, state, info, finite):
        v, b, r, width = self.view, self.size, self.config.rank, self._width()
        mats = ops.reshape(x, (b,) + tuple(v.natural))
        if self.config.error_feedback:
            mats = mats + state.residual
        even = ops.bitwise_and(state.step, 1) < 1
        local, shared = ops.select(
            even, lambda: (pad_batch(ops, times_right_batch(ops, mats, state.q, v), width), pad_batch(ops, state.q, width)),
            lambda: (pad_batch(ops, times_left_batch(ops, mats, state.p, v), width), pad_batch(ops, state.p, width)))
        # Step 5: one pair of fingerprints, the members' summed.
        f = ops.sum(ops.matmul(self._fingerprint_weights(ops, state.fill), ops.reshape(shared, (b, r * width, 1))), 0)
        e = ops.reshape(ops.cast(even, "float32"), (1,))
        control = ops.concat([e, 1.0 - e, ops.reshape(ops.concat([f, f * f], 1), (4,))], 0)
        payload = poison(ops, ops.concat([ops.reshape(local, (b * r * width,)), control], 0), finite)
        return payload, _AltCtx(even, mats if self.config.error_feedback else None, local, state.p, state.q)

    def _fingerprint_weights(self, ops, fill):
        """float32 [B, 2, r K]: each member's U and U^2 - 1/3 (as per matrix), kept while the
        state holds the same fill tensor and the backend runs eagerly."""
        if self._weights is not None and self._weights[0] is fill:
            return self._weights[1]
        b, r, k = ops.shape(fill)
        weights = ops.reshape(ops.concat([fill, fill * fill - 1.0 / 3.0], 1), (b, 2, r * k))
        if ops.eager():
            self._weights = (fill, weights)
        return weights

    def receive(self, ops, payload, ctx, info):
        """``ctx`` with ``keep`` and ``ok`` (step 8, for the whole batch)."""
        keep, ok = ops.fuse(_agree_kernel, info.world_size)(payload)
        return ctx._replace(keep=keep, ok=ok)

    def _agg(self, ops, payload):
        b, r, width = self.size, self.config.rank, self._width()
        return ops.reshape(payload[:b * r * width], (b, r, width))

    def decompress(self, ops, payload, ctx, info):
        """float32 ``[B, *natural]`` (the group's flat order; finish_tensor reshapes): step 9."""
        v, agg = self.view, self._agg(ops, payload)
        a, b = ops.select(ctx.even, lambda: (agg[:, :, :v.n], ctx.q), lambda: (ctx.p, agg[:, :, :v.m]))
        return outer_batch(ops, a * ctx.keep, b, v)  # NaN * 0 stays NaN

    def finish(self, ops, payload, ctx, state, info):
        """The state after the step (step 10); unchanged if the payload is not finite."""
        v, agg = self.view, self._agg(ops, payload)
        agreed = ctx.keep > 0.5
        rows = ops.fuse(basis_rows_batched, DEPENDENT_TOL)
        p, q = ops.select(ops.logical_and(ctx.even, agreed),
                          lambda: (rows(agg[:, :, :v.n], state.fill[:, :, :v.n]), state.q),
                          lambda: (state.p * ctx.keep, rows(agg[:, :, :v.m], state.fill[:, :, :v.m])))
        step = ops.where(agreed, state.step + 1, state.step * 0)
        realigned = state.realigned + (1 - ops.cast(agreed, "int64"))
        residual = state.residual
        if self.config.error_feedback:
            local_p, local_q = ops.select(ctx.even, lambda: (ctx.local[:, :, :v.n], state.q),
                                          lambda: (state.p, ctx.local[:, :, :v.m]))
            residual = ctx.matrix - outer_batch(ops, local_p * ctx.keep, local_q, v)
        new = commit(ops, ctx.ok, PowerSGDState(residual, p, q, step, state.fill, realigned, state.version), state)
        self.agreed = (new.p, new.q, new.step, new.fill)
        self.inner.batch_clock += 1
        self.stepped = self.inner.batch_clock
        return new

    def row(self, key):
        """Member ``key``'s agreed fields ``(p [r, n], q [r, m], step, fill [r, K])`` as the batch
        holds them now (its stored state, else its last step's), or None: for
        :meth:`PowerSGDScheme.init <hvd_gradcomp.powersgd.PowerSGDScheme.init>` when the member
        leaves the batch to be sent alone (a rebuilt bucket with no other matrix of its view)."""
        store = self.book.store
        state = store.read(self.gkey) if store.has(self.gkey) else None
        fields = (state.p, state.q, state.step, state.fill) if isinstance(state, PowerSGDState) else self.agreed
        if fields is None:
            return None
        j = self.keys.index(key)
        p, q, step, fill = fields
        return p[j], q[j], step, fill[j]

    # ---- facts ----
    def wire(self, info: TensorInfo) -> WireBytes:
        """One payload for the batch: ``4 (B r max(n, m) + 6)`` bytes."""
        return WireBytes(4 * (self.size * self.config.rank * self._width() + CONTROL))

    def metrics(self, state) -> dict:
        return self.inner.metrics(state)

    def check_loaded(self, key, loaded):
        self.inner.check_loaded(key, loaded)

    def spec(self) -> str:
        return self.inner.spec()
