"""Framework-neutral half of the Horovod compressor objects (``Compression.<name>(...)``):
the Horovod glue.

Horovod calls ``compress(tensor) -> (payload, ctx)`` and ``decompress(payload, ctx)`` and
passes no name, step or op. A :class:`HorovodCompressor` *holds* the engine-neutral
:class:`~hvd_gradcomp.codec.Codec` (its ``codec``: routes, states, bucket groups, the
encode/decode entry points that the DDP hook, FSDP and update sync call) and a
:class:`~hvd_gradcomp.frontend.Frontend` (its ``frontend``: what Horovod's calling frame says
about the call, :class:`Call`: the tensor's key, op, scale factors, process set, owner; and
the framework's facts). This module keeps Horovod's contract: call discovery, Horovod's
grouped all-reduces (:mod:`~hvd_gradcomp.grouped`), and the user's methods (checkpoints,
reports, ``route``, ``calibrate``, ``set_loss_scale``), each a call into the codec or a
function over it. The backends (``torch_backend.compression``, ``tf_backend.compression``)
hand it their primitives, frontend and store (plain tensors in PyTorch, ``tf.Variable``s in
TensorFlow). Before anything is computed the codec refuses, on every rank, what the scheme
cannot take (an op, a scale factor, a blocking variant on a gradient Horovod fills in).

Each instance belongs to one training run. A second optimizer (or, in TensorFlow, another
variable at the same gradient position) using the same instance gets its own state.

Which scheme sends a tensor is decided once, the first time the compressor sees it, by its
:class:`~hvd_gradcomp.routing.RouteTable` (rules on names and sizes, a default scheme, fp16
below ``min_numel`` and for what the scheme does not accept), and kept with the tensor's
state; checkpoints record it.

Grouped all-reduces (TensorFlow's one-dtype groups, PyTorch's groups sent as buckets):
:mod:`~hvd_gradcomp.grouped`. The entry points of other engines (DDP, FSDP, update sync):
:mod:`~hvd_gradcomp.codec`.

Sparse gradients (PyTorch ``sparse=True`` embeddings without ``sparse_as_dense``, TensorFlow
``IndexedSlices``) never reach ``compress``: Horovod's sparse path gathers their indices and values. The
adapter notices them (PyTorch: in ``decompress``; TensorFlow: in the same ``allreduce_grads``
call), logs a warning naming the tensor once, and counts their bytes in
``bytes_per_step().sparse`` and ``metrics()``.
"""
import logging

from . import checkpoint, link, reports
from .calls import Call, scheme_info
from .codec import Codec
from .grouped import WidenedCtx, PieceCtx, compress_bucket, compress_grouped, decompress_piece, narrowed
from .horovod_ops import HorovodCollectives
from .primitives import FLOAT_DTYPES
from .routing import with_min_numel

__all__ = ["HorovodCompressor", "Call", "scheme_info"]

log = logging.getLogger("hvd_gradcomp")


class HorovodCompressor:
    """A Horovod compressor (``Compression.<name>(...)``): Horovod's contract over an owned codec.

    Fields:
        codec: the :class:`~hvd_gradcomp.codec.Codec` (engines call it: ``plan_bucket``,
            ``encode_unit``, ``encode``, ``decode``, ``bind_engine``, ...).
        frontend: the framework's :class:`~hvd_gradcomp.frontend.Frontend` (Horovod's frames).
        in_group: TensorFlow grouped all-reduce: (group list, {id(tensor): (payload, ctx)}) of
            the members not yet returned, or None.
        pieces: PyTorch grouped all-reduce sent as a bucket: {id(gradient): (piece, ctx)} not
            yet returned, or None.
        warned: group compositions warned about once.

    Public methods (both frameworks):
        compress(tensor, name=None) / decompress(payload, ctx): Horovod's contract.
        route(params, check=True): decide (and compare across ranks) each parameter's route
            before training; needed in TensorFlow for rules on names.
        state_dict(gather=False) / load_state_dict(d, rank=None): checkpoints, per rank or
            gathered for a rank-0 save.
        wire_bytes() -> {key: WireBytes}; bytes_per_step() -> StepBytes summed over tensors,
            sparse gradients included; sparse_bytes() -> {key: bytes}.
        metrics() -> {key: {name: value}} diagnostics (e.g. THC's saturated count).
        routes() -> {key: scheme spec}: the route of every tensor seen; decisions(): auto's.
        error_feedback(key): a tensor's pending error feedback.
        spec: the text spec of the compressor (its routing); scheme: the default scheme;
        routing: the :class:`~hvd_gradcomp.routing.Routing`; table: its
        :class:`~hvd_gradcomp.routing.RouteTable`; engine: the bound engine or None.
    """

    __slots__ = ("codec", "frontend", "in_group", "pieces", "warned", "__weakref__")

    def __init__(self, routing, ops, store, frontend):
        """Args: routing: a :class:`~hvd_gradcomp.routing.Routing`, or one scheme (all tensors
        to it, those below its ``min_numel`` as fp16); ops: the backend's primitives; store:
        where the scheme states live (:class:`~hvd_gradcomp.store.Store`); frontend: the
        framework's :class:`~hvd_gradcomp.frontend.Frontend`."""
        self.frontend = frontend
        self.codec = Codec(routing, ops, store, frontend, HorovodCollectives(frontend.horovod))
        self.in_group = self.pieces = None
        self.warned = set()
        if any(s.adaptive and s.link is None for s in self.codec.routing.schemes()) and \
                self.codec.global_world()[0] is not None:
            self.calibrate(cached=True)  # an adaptive scheme without a given link: measured once per process

    # ---- what the codec holds, by name ----
    @property
    def ops(self):
        """The backend's :class:`~hvd_gradcomp.primitives.Primitives`."""
        return self.codec.ops

    @property
    def spec(self) -> str:
        """The compressor's canonical text spec (``Compression.from_spec`` rebuilds it)."""
        return self.codec.spec

    @property
    def routing(self):
        return self.codec.routing

    @property
    def scheme(self):
        """The routing's default scheme."""
        return self.codec.routing.default

    @property
    def table(self):
        return self.codec.table

    @property
    def engine(self):
        """The engine bound to the codec (``codec.bind_engine``), or None (Horovod's collectives)."""
        return self.codec.engine

    def set_loss_scale(self, source):
        """Keep error feedback in unscaled units under loss scaling.

        Args:
            source: PyTorch's ``torch.cuda.amp.GradScaler`` / ``torch.amp.GradScaler``, Keras'
                ``LossScaleOptimizer``, a 0-d tensor or variable holding the scale, or None
                (no loss scaling, the default).

        With a source, ``compress`` divides the (scaled) gradient by the current scale S
        before error feedback and compression, and ``decompress`` multiplies the result by S
        again, so Horovod's caller still receives scaled gradients (which the scaler then
        unscales and checks), while every residual stays in the gradient's own units: a
        change of scale between steps no longer replays old residuals at S_old / S_new. The
        scale is read on the device, never on the host. All ranks must use the same scale,
        which they do when every rank's scaler sees the same (all-reduced) gradients.
        Returns self.
        """
        self.codec.scale_source = source
        return self

    # ---- Horovod's contract ----
    def compress(self, tensor, name=None):
        """Compress one gradient. Returns ``(payload, ctx)``; see the scheme's docs for layout.

        Args:
            tensor: the gradient (any shape; float tensors are routed and compressed, others
                and empty tensors are returned untouched as their own payload).
            name: the tensor's stable identity (and the name routing rules match); found from
                Horovod's call frames when None.

        Raises:
            ValueError: the tensor cannot be identified (stateful schemes, rules on names), its
                shape/dtype differs from the state kept (or loaded) under its key, its route
                differs from the checkpoint's, it is a sparse gradient in PyTorch's grouped
                path, or Horovod would apply an op or scaling its scheme's payload cannot
                take. Raised before any collective, on every rank alike.
        """
        frontend = self.frontend
        if frontend.is_sparse(tensor):
            call = frontend.find_call(tensor)
            raise ValueError(f"{self.spec}: tensor {name or call.key!r} has a sparse gradient, which "
                             f"Horovod's groups= path hands to compress (without groups it would "
                             f"send it uncompressed on its sparse path); pass sparse_as_dense=True to "
                             f"hvd.DistributedOptimizer")
        if self.ops.dtype(tensor) not in FLOAT_DTYPES:
            return tensor, None
        call = frontend.find_call(tensor)
        if name is not None:
            call = call._replace(key=name, label=name, pin=None)
        if call.batch is not None:
            frontend.watch_sparse(call, self)
        if call.group is not None and len(call.group) > 1:
            return compress_grouped(self, tensor, call)
        if call.bucket is not None and len(call.bucket) > 1:
            done = compress_bucket(self, tensor, call)
            if done is not None:
                return done
        payload, ctx, _ = self.codec.encode_call(tensor, call, frontend.no_key_message)
        return payload, ctx

    def decompress(self, payload, ctx):
        """The all-reduced payload mapped back to the gradient's shape and dtype; the tensor's
        state moves on (or stays, if the payload says some rank failed this step)."""
        if isinstance(ctx, PieceCtx):
            return decompress_piece(self, payload, ctx)
        if isinstance(ctx, WidenedCtx):
            payload = narrowed(self.ops, payload, ctx.dtype)
            ctx = ctx.inner
        if ctx is None:
            self.frontend.uncompressed(payload, self)
            return payload
        return self.codec.decode_call(payload, ctx)

    # ---- the user's methods: calls into the codec ----
    def route(self, params, check: bool = True) -> list:
        """Decide each parameter's route now, and check that every rank decides alike
        (:meth:`~hvd_gradcomp.routing.RouteTable.route`).

        Needed in TensorFlow when rules match names (variable names may differ between ranks,
        see :mod:`~hvd_gradcomp.routing`): call it on every rank once the model's variables
        exist, before the first step. In PyTorch the routes follow from Horovod's parameter
        names, equal on every rank; ``route()`` then only shows and checks them.

        Args:
            params: PyTorch: ``model.named_parameters()``; TensorFlow:
                ``model.trainable_variables`` (or ``(name, variable)`` pairs).
            check: compare the ranks' decisions (one object gather: every rank must call
                ``route()`` then); False decides locally, without a collective.

        Returns ``[(name, scheme spec or None), ...]``; ValueError on every rank if the ranks
        disagree.
        """
        return self.codec.route(params, check)

    def routes(self) -> dict:
        """``{key: scheme spec}``: the route of every tensor seen so far."""
        return reports.routes(self.codec)

    def wire_bytes(self) -> dict:
        """``{key: WireBytes}``: bytes per step and rank of every tensor seen
        (:func:`hvd_gradcomp.reports.wire_bytes`)."""
        return reports.wire_bytes(self.codec)

    def bytes_per_step(self):
        """:meth:`wire_bytes` summed, plus sparse gradients (:func:`hvd_gradcomp.reports.bytes_per_step`)."""
        return reports.bytes_per_step(self.codec)

    def sparse_bytes(self) -> dict:
        """``{key: bytes}`` of each sparse gradient seen (:func:`hvd_gradcomp.reports.sparse_bytes`)."""
        return reports.sparse_bytes(self.codec)

    def metrics(self) -> dict:
        """``{key: {name: value}}`` diagnostics (:func:`hvd_gradcomp.reports.metrics`)."""
        return reports.metrics(self.codec)

    def decisions(self) -> list:
        """Every ``auto`` decision, oldest first (:func:`hvd_gradcomp.reports.decisions`)."""
        return reports.decisions(self.codec)

    def error_feedback(self, key):
        """Tensor ``key``'s pending error feedback, float32 ``[numel]``, or None
        (:meth:`hvd_gradcomp.codec.Codec.error_feedback`)."""
        return self.codec.error_feedback(key)

    def state_dict(self, gather: bool = False) -> dict:
        """The compressor's state for a checkpoint: this rank's, or (``gather=True``, a
        collective) every rank's for a rank-0 save (:func:`hvd_gradcomp.checkpoint.state_dict`)."""
        return checkpoint.state_dict(self.codec, gather)

    def load_state_dict(self, state_dict: dict, rank=None):
        """Restore what :meth:`state_dict` returned; ValueError for another compressor's, another
        rank's or a damaged state (:func:`hvd_gradcomp.checkpoint.load_state_dict`)."""
        return checkpoint.load_state_dict(self.codec, state_dict, rank)

    def calibrate(self, process_set=None, sizes=(1 << 10, 1 << 21), repeats: int = 3, like=None,
                  cached: bool = False):
        """Measure the link for this compressor's ``auto`` schemes: a collective, on every rank
        of ``process_set`` at the same point. Arguments, return (the
        :class:`~hvd_gradcomp.auto.Link`) and method: :func:`hvd_gradcomp.link.calibrate`."""
        return link.calibrate(self.codec, process_set, sizes, repeats, like, cached)

    def __repr__(self):
        from .options import to_spec
        text = (with_min_numel(to_spec(self.scheme, full=True), self.routing.min_numel)
                if self.routing.plain else self.spec)
        return f"{type(self).__name__}({text!r})"
