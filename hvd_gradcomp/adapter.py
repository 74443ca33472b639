"""Framework-neutral half of the Horovod compressor objects (``Compression.<name>(...)``):
the Horovod glue.

Horovod calls ``compress(tensor) -> (payload, ctx)`` and ``decompress(payload, ctx)`` and
passes no name, step or op. The engine-neutral jobs, shared with the DDP hook
(:mod:`torch_backend.ddp`), FSDP and update sync: the entry points of other engines
(:mod:`~hvd_gradcomp.engine_codec`), the bucketed codec (:mod:`~hvd_gradcomp.buckets`) and
per-tensor records (static facts, route, wire bytes: :mod:`~hvd_gradcomp.records`) are still
base classes; checkpoints (:mod:`~hvd_gradcomp.checkpoint`), link calibration
(:mod:`~hvd_gradcomp.link`) and Horovod's grouped all-reduces (:mod:`~hvd_gradcomp.grouped`)
are functions over the compressor; each tensor's scheme state lives in the compressor's
``store`` (:class:`~hvd_gradcomp.store.Store`). This module keeps Horovod's contract, call
discovery, the checks of what Horovod would do to a payload, the loss scale and the engine
seam (``_world``, ``_from_every_rank``, ``_allreduce_host``: Horovod's, or a bound
:class:`~hvd_gradcomp.engine.Engine`'s). The backend subclasses supply the primitives, what
Horovod's calling frame says about the call (:class:`Call`: the tensor's key, op, scale
factors, process set, owner), and the store (plain tensors in PyTorch, ``tf.Variable``s in
TensorFlow). Before anything is computed it refuses, on every rank, what the scheme
cannot take (an op, a scale factor, a blocking variant on a gradient Horovod fills in).

Each instance belongs to one training run. A second optimizer (or, in TensorFlow, another
variable at the same gradient position) using the same instance gets its own state.

Which scheme sends a tensor is decided once, the first time the compressor sees it, by its
:class:`~hvd_gradcomp.routing.RouteTable` (rules on names and sizes, a default scheme, fp16
below ``min_numel`` and for what the scheme does not accept), and kept with the tensor's
state; checkpoints record it.

Grouped all-reduces (TensorFlow's one-dtype groups, PyTorch's groups sent as buckets):
:mod:`~hvd_gradcomp.grouped`. The entry points of other engines (DDP, FSDP, update sync):
:mod:`~hvd_gradcomp.engine_codec`.

Sparse gradients (PyTorch ``sparse=True`` embeddings without ``sparse_as_dense``, TensorFlow
``IndexedSlices``) never reach ``compress``: Horovod's sparse path gathers their indices and values. The
adapter notices them (PyTorch: in ``decompress``; TensorFlow: in the same ``allreduce_grads``
call), logs a warning naming the tensor once, and counts their bytes in
``bytes_per_step().sparse`` and ``metrics()``.
"""
import logging

from . import composite
from .base import EmptyState, Scheme, TensorInfo, compress_tensor, finish_tensor, passes_through
from .buckets import Buckets
from .calls import AdapterCtx as _AdapterCtx, Call, scheme_info
from . import checkpoint
from .engine_codec import EngineCodec
from .grouped import WidenedCtx, PieceCtx, compress_bucket, compress_grouped, decompress_piece, narrowed
from . import link
from .primitives import FLOAT_DTYPES
from .horovod_ops import horovod_nccl_avg
from .records import TensorRecords
from .routing import RouteTable, Routing, with_min_numel
from .store import DictStore

__all__ = ["HorovodCompressor", "Call", "scheme_info"]

log = logging.getLogger("hvd_gradcomp")


class HorovodCompressor(EngineCodec, Buckets, TensorRecords):
    """Base of ``torch_backend.Compressor`` and ``tf_backend.Compressor``.

    Public methods (both frameworks):
        compress(tensor, name=None) / decompress(payload, ctx): Horovod's contract.
        route(params, check=True): decide (and compare across ranks) each parameter's route
            before training; needed in TensorFlow for rules on names.
        state_dict(gather=False) / load_state_dict(d, rank=None): checkpoints, per rank or
            gathered for a rank-0 save.
        wire_bytes() -> {key: WireBytes}; bytes_per_step() -> StepBytes summed over tensors,
            sparse gradients included; sparse_bytes() -> {key: bytes}.
        metrics() -> {key: {name: value}} diagnostics (e.g. THC's saturated count).
        routes() -> {key: scheme spec}: the route of every tensor seen.
        spec: the text spec of the compressor (its routing); scheme: the default scheme;
        routing: the :class:`~hvd_gradcomp.routing.Routing`; table: its
        :class:`~hvd_gradcomp.routing.RouteTable`.
    """

    __slots__ = (
        # configuration: the routing, and its default scheme
        "routing", "scheme",
        # the route of each tensor (routing.RouteTable)
        "table",
        # per-tensor bookkeeping, keyed by the tensor's stable identity
        "_infos", "_wire",
        # states loaded by load_state_dict() before the tensor was first seen
        "_pending",
        # per key, the owners seen (optimizers, variables), in order of first use
        "_owners",
        # sparse gradients seen: key -> backend entry of (bytes last step, steps)
        "_sparse",
        # TensorFlow grouped all-reduce: (group list, {id(tensor): (payload, ctx)}) not yet returned
        "_group",
        # warnings already given (group compositions; DDP: a joined rank's dropped error feedback)
        "_warned",
        # loss scale source (GradScaler / LossScaleOptimizer), see set_loss_scale()
        "_scale_source",
        # None: Horovod's collectives; else the engine whose collectives the compressor uses
        # outside compress (world, checkpoints, route checks, calibrate), e.g. DDP's
        "_engine",
        # the bucketed codec (buckets.Buckets): flat groups, where each tensor's error feedback
        # is, bucket plans, a checkpoint's group fields, member infos, groups being left
        "_groups", "_members", "_plans", "_pending_groups", "_member_infos", "_leaving", "_holders",
        # PyTorch grouped all-reduce sent as a bucket: {id(gradient): (piece, ctx)} not yet returned
        "_pieces",
        # each tensor's (or bucket group's) scheme state (store.Store)
        "store",
        "__weakref__",
    )
    ops = None  # the backend's Primitives (class attribute of the subclass)

    def __init__(self, routing, store=None):
        """Args: routing: a :class:`~hvd_gradcomp.routing.Routing`, or one scheme (all tensors
        to it, those below its ``min_numel`` as fp16, as :meth:`Routing.single`); store: where
        the scheme states live (a :class:`~hvd_gradcomp.store.Store`; default a
        :class:`~hvd_gradcomp.store.DictStore`)."""
        self.store = DictStore(self.ops) if store is None else store
        if isinstance(routing, Scheme):
            routing = Routing.single(routing)
        self.routing = routing.bind(self.ops)
        self.scheme = self.routing.default
        self.table = RouteTable(self.routing)
        self._infos = {}
        self._wire = {}
        self._pending = {}
        self._owners = {}
        self._sparse = {}
        self._group = None
        self._warned = set()
        self._scale_source = None
        self._engine = None
        self._groups, self._members, self._plans = {}, {}, {}
        self._pending_groups, self._member_infos, self._leaving, self._holders = {}, {}, {}, {}
        self._pieces = None
        if any(s.adaptive and s.link is None for s in self.routing.schemes()) and \
                self._global_world()[0] is not None:
            self.calibrate(cached=True)  # an adaptive scheme without a given link: measured once per process
    # ---- backend hooks ----
    no_key_message = "{scheme}: cannot tell which tensor this is; call compress(tensor, name=...)"
    @staticmethod
    def _find_call(tensor) -> Call:
        """The :class:`Call` read from Horovod's calling frames (key None when not found)."""
        raise NotImplementedError
    @staticmethod
    def _horovod():
        """The framework's Horovod module (horovod.torch or horovod.tensorflow)."""
        raise NotImplementedError

    def _on_gpu(self, tensor) -> bool:
        """True if Horovod will all-reduce ``tensor`` (or its payload) on a GPU; default False."""
        return False

    def _world(self, process_set):
        """(world_size, rank) of the all-reduce: the process set's, or the global ones (with
        an engine bound, its process group's)."""
        if self._engine is not None:
            return self._engine.world()
        hvd = self._horovod()
        if process_set is None or getattr(process_set, "process_set_id", 0) == 0:
            return hvd.size(), hvd.rank()
        return process_set.size(), process_set.rank()
    def _global_world(self):
        """(size, rank) of Horovod's global set, or (None, None) before ``hvd.init()``."""
        try:
            return self._world(None)
        except (ValueError, ImportError):  # "Horovod has not been initialized", or no Horovod
            return None, None
    def _is_sparse(self, tensor) -> bool:
        """True for a sparse gradient handed to compress (PyTorch ``groups=``); default False."""
        return False
    def _watch_sparse(self, call: Call):
        """Note the sparse gradients of ``call.batch`` (TensorFlow); default: nothing."""
    def _uncompressed(self, payload):
        """Called by decompress for a payload compress never saw (PyTorch notes sparse ones)."""
    @staticmethod
    def _scale_of(source):
        """The current loss scale of ``source`` as a 0-d float32 tensor on device (no host read)."""
        raise NotImplementedError
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
        self._scale_source = source
        return self
    def _static(self, tensor, call: Call):
        """``tensor`` with a fully known static shape (TensorFlow overrides); default: itself."""
        return tensor
    def _detach(self, tensor):
        """The gradient without any autograd history (PyTorch); default: itself."""
        return tensor
    @property
    def codec(self):
        """The engine-neutral codec engines call (``plan_bucket``, ``encode_unit``, ``encode``,
        ``decode``, ``decode_joined``, ``decode_scattered``, ``linear_decode``,
        ``add_error_feedback``, ``bind_engine``)."""
        return self
    # ---- Horovod's contract ----
    @property
    def spec(self) -> str:
        """The compressor's canonical text spec (``Compression.from_spec`` rebuilds it)."""
        return self.routing.spec()
    @staticmethod
    def _check_call(s: Scheme, key, call: Call, info: TensorInfo):
        """Refuse, before any collective, what Horovod would do to a payload scheme ``s`` cannot take."""
        if s.identity or s.linear:
            if call.op == "product" and not s.identity:
                raise ValueError(f"{s.name}: tensor {key!r}: op=Product of pre-scaled payloads is not "
                                 f"the product of the gradients; use op=Sum or Average")
            return
        if call.op not in (None, "sum", "average"):
            raise ValueError(f"{s.name}: tensor {key!r}: op={call.op.capitalize()} cannot combine "
                             f"{s.name} payloads (selected or quantised per step); {s.name} supports "
                             f"op=Sum and op=Average only. Use Compression.fp16() or none with "
                             f"op={call.op.capitalize()}")
        if not s.scalable and (call.prescale != 1.0 or call.postscale != 1.0):
            raise ValueError(f"{s.name}: tensor {key!r}: Horovod would scale the payload "
                             f"(gradient_predivide_factor / prescale_factor={call.prescale:g}, "
                             f"postscale_factor={call.postscale:g}), which corrupts {s.name}'s "
                             f"integer payload; leave these factors at 1 with this compressor")
        if call.filled_in and composite.blocks(s, info):
            raise ValueError(f"{s.spec()}: tensor {key!r} had no gradient on this rank, so Horovod's "
                             f"synchronize() fills it in, in an order that differs between ranks; "
                             f"this variant posts a blocking side all-reduce inside compress and "
                             f"would hang. Use the default (single-collective) variant of "
                             f"{s.name}")
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
        if self._is_sparse(tensor):
            call = self._find_call(tensor)
            raise ValueError(f"{self.spec}: tensor {name or call.key!r} has a sparse gradient, which "
                             f"Horovod's groups= path hands to compress (without groups it would "
                             f"send it uncompressed on its sparse path); pass sparse_as_dense=True to "
                             f"hvd.DistributedOptimizer")
        if self.ops.dtype(tensor) not in FLOAT_DTYPES:
            return tensor, None
        call = self._find_call(tensor)
        if name is not None:
            call = call._replace(key=name, label=name, pin=None)
        if call.batch is not None:
            self._watch_sparse(call)
        if call.group is not None and len(call.group) > 1:
            return compress_grouped(self, tensor, call)
        if call.bucket is not None and len(call.bucket) > 1:
            done = compress_bucket(self, tensor, call)
            if done is not None:
                return done
        payload, ctx, _ = self._compress_one(tensor, call)
        return payload, ctx
    def _compress_one(self, tensor, call: Call):
        """``(payload, ctx, key)`` of one tensor (key None when it passed through untouched)."""
        ops = self.ops
        dtype = ops.dtype(tensor)
        if dtype not in FLOAT_DTYPES:
            return tensor, None, None
        tensor = self._static(tensor, call)
        shape = ops.shape(tensor)
        numel = 1
        for s in shape:
            numel *= s
        if passes_through(dtype, numel):
            return tensor, None, None
        key = self._key(call)
        info = self._info(key, shape, dtype, call, tensor)
        route = self.table.of(key, call.label if call.label is not None else call.key, call.pin, info)
        if key in self.table.superseded:  # a checkpoint's state of the scheme that now refuses it
            self.table.superseded.discard(key)
            self._pending.pop(key, None)
        scheme = route.scheme
        unnamed = key is None
        if unnamed and type(scheme).init is not Scheme.init and not scheme.state_optional:
            raise ValueError(self.no_key_message.format(scheme=scheme.name))
        self._check_call(scheme, info.key, call, info)
        payload, ctx = self._encode_info(tensor, info, scheme, keyed=not unnamed)
        return payload, ctx, info.key

    def _info(self, key, shape, dtype, call: Call, tensor) -> TensorInfo:
        """The :class:`TensorInfo` of a tensor sent under ``key`` by ``call``."""
        world_size, rank = self._world(call.process_set)
        op = call.op if call.op in ("sum", "average") else None
        # Horovod's NCCL Average divides by n before summing: schemes then skip their 1/n.
        # (An engine's all-reduce, e.g. DDP's, divides nothing: schemes pre-scale themselves.)
        nccl_avg = self._engine is None and op == "average" and world_size > 1 and \
            self._on_gpu(tensor) and horovod_nccl_avg(self._horovod())
        # "<unnamed>": a tensor without a key, for stateless schemes only (any key will do).
        return TensorInfo("<unnamed>" if key is None else key, shape, dtype, world_size, rank, op,
                          call.process_set, nccl_avg)

    def _encode_info(self, tensor, info: TensorInfo, scheme: Scheme, detach: bool = True, keyed: bool = True):
        """``(payload, ctx)`` of ``tensor`` under ``info`` and its route's ``scheme``: the
        records (static facts, wire bytes), the loss scale, the state (none for a tensor
        without a key, ``keyed=False``: a ``state_optional`` scheme's), the scheme's compress.
        Shared by one tensor (:meth:`_compress_one`) and a bucket's flat group
        (:mod:`~hvd_gradcomp.buckets`)."""
        ops, key = self.ops, info.key
        known = self._infos.get(key)
        if known is not None and (known.shape, known.dtype) != (info.shape, info.dtype):
            raise ValueError(f"{scheme.name}: tensor {key!r} was {known.dtype}{list(known.shape)} "
                             f"in earlier steps, got {info.dtype}{list(info.shape)}; one key, one shape")
        if known != info or scheme.adaptive:  # static per tensor, except for adaptive schemes
            self._wire[key] = scheme.wire(info)
        self._infos[key] = info
        if scheme.identity:
            return tensor, None
        if detach:  # (a bucket's buffer has no autograd history)
            tensor = self._detach(tensor)
        scale = None
        if self._scale_source is not None:
            scale = self._scale_of(self._scale_source)
            tensor = ops.cast(tensor, "float32") * (1.0 / scale)
        state = self._state_for(scheme, info, tensor) if keyed else EmptyState()
        payload, ctx = compress_tensor(scheme, ops, tensor, state, scheme_info(info, scale))
        return payload, _AdapterCtx(info, ctx, scale, scheme)

    def decompress(self, payload, ctx):
        """The all-reduced payload mapped back to the gradient's shape and dtype; the tensor's
        state moves on (or stays, if the payload says some rank failed this step)."""
        if isinstance(ctx, PieceCtx):
            return decompress_piece(self, payload, ctx)
        if isinstance(ctx, WidenedCtx):
            payload = narrowed(self.ops, payload, ctx.dtype)
            ctx = ctx.inner
        if ctx is None:
            self._uncompressed(payload)
            return payload
        info, scheme_ctx, scale, scheme = ctx
        has_state = self._has_state(info.key)
        state = self._read_state(info.key) if has_state else EmptyState()
        out, new_state = finish_tensor(scheme, self.ops, payload, scheme_ctx, state,
                                       scheme_info(info, scale), dtype=info.dtype, scale=scale)
        if has_state and new_state is not state:
            self._write_state(info.key, new_state)
        return out

    def state_dict(self, gather: bool = False) -> dict:
        """The compressor's state for a checkpoint: this rank's, or (``gather=True``, a
        collective) every rank's for a rank-0 save (:func:`hvd_gradcomp.checkpoint.state_dict`)."""
        return checkpoint.state_dict(self, gather)

    def load_state_dict(self, state_dict: dict, rank=None):
        """Restore what :meth:`state_dict` returned; ValueError for another compressor's, another
        rank's or a damaged state (:func:`hvd_gradcomp.checkpoint.load_state_dict`)."""
        return checkpoint.load_state_dict(self, state_dict, rank)

    def _job_world(self):
        """(world size, rank) of this process: the bound engine's group (DDP) or Horovod's
        global set (:meth:`_global_world`), else the framework's own process group
        (:meth:`_process_world`: ``torch.distributed``'s default group, so a checkpoint loads
        before ``register_comm_hook``); (None, None) when none is initialised."""
        size, rank = self._global_world()
        return (size, rank) if size is not None else self._process_world()

    def _process_world(self):
        """(world size, rank) of the framework's own initialised process group, without
        Horovod; default (None, None). PyTorch: ``torch.distributed``'s default group."""
        return None, None

    def calibrate(self, process_set=None, sizes=(1 << 10, 1 << 21), repeats: int = 3, like=None,
                  cached: bool = False):
        """Measure the link for this compressor's ``auto`` schemes: a collective, on every rank
        of ``process_set`` at the same point. Arguments, return (the
        :class:`~hvd_gradcomp.auto.Link`) and method: :func:`hvd_gradcomp.link.calibrate`."""
        return link.calibrate(self, process_set, sizes, repeats, like, cached)

    # ---- the engine's collectives outside compress ----
    def _allreduce_host(self, x, average: bool, name: str, process_set=None):
        """``x`` summed (``average``: averaged) over the ranks, blocking, outside compress
        (calibrate only): Horovod's all-reduce, or the bound engine's."""
        if self._engine is not None:
            return self._engine.allreduce(x, average)
        hvd = self._horovod()
        kwargs = {} if process_set is None else {"process_set": process_set}
        return hvd.allreduce(x, op=hvd.Average if average else hvd.Sum, name=name, **kwargs)

    def _from_every_rank(self, obj, name: str) -> list:
        """``[obj of rank 0, obj of rank 1, ...]`` on every rank (global set), by one
        ``hvd.broadcast_object`` per rank in rank order. Outside compress (route checks and
        checkpoints only); gradient payloads never travel this way. With an engine bound: its
        object gather over its process group."""
        if self._engine is not None:
            return self._engine.gather(obj)
        hvd = self._horovod()
        return [hvd.broadcast_object(obj, root_rank=r, name=f"{name}.{r}") for r in range(hvd.size())]

    def __repr__(self):
        from .options import to_spec
        text = (with_min_numel(to_spec(self.scheme, full=True), self.routing.min_numel)
                if self.routing.plain else self.spec)
        return f"{type(self).__name__}({text!r})"
