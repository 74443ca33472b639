"""Framework-neutral half of the Horovod compressor objects (``Compression.<name>(...)``):
the Horovod glue.

Horovod calls ``compress(tensor) -> (payload, ctx)`` and ``decompress(payload, ctx)`` and
passes no name, step or op. The engine-neutral jobs live in mixins of their own, shared with
the DDP hook (:mod:`torch_backend.ddp`): per-tensor records (static facts, route, wire bytes,
state: :mod:`~hvd_gradcomp.records`), checkpoints (:mod:`~hvd_gradcomp.checkpoint`) and link
calibration (:mod:`~hvd_gradcomp.link`). This module keeps Horovod's contract, call
discovery, the checks of what Horovod would do to a payload, TensorFlow's groups, the loss
scale and the engine seam (``_world``, ``_from_every_rank``, ``_allreduce_host``: Horovod's,
or a bound engine's). The backend subclasses supply the primitives,
what Horovod's calling frame says about the call (:class:`Call`: the tensor's key, op, scale
factors, process set, owner), and state storage (plain tensors in PyTorch, ``tf.Variable``s
in TensorFlow). Before anything is computed it refuses, on every rank, what the scheme
cannot take (an op, a scale factor, a blocking variant on a gradient Horovod fills in).

Each instance belongs to one training run. A second optimizer (or, in TensorFlow, another
variable at the same gradient position) using the same instance gets its own state.

Which scheme sends a tensor is decided once, the first time the compressor sees it, by its
:class:`~hvd_gradcomp.routing.RouteTable` (rules on names and sizes, a default scheme, fp16
below ``min_numel`` and for what the scheme does not accept), and kept with the tensor's
state; checkpoints record it.

TensorFlow's grouped all-reduce (``num_groups``/``groups``) sends a group in one collective,
which takes one dtype (``HorovodGroupedAllreduce`` has one type attribute), while a group may
hold payloads of several (THC's int32 words, fp16 for small tensors, PowerSGD's float32
factors). At the first member's ``compress`` the adapter compresses the whole group (Horovod's
frame holds it), and if the payload dtypes differ it casts each to the narrowest dtype that
holds every member's values and sums exactly (float16 + float32: float32; with int32 or
float64: float64), and back before ``decompress``: one collective per group as Horovod meant,
the same numbers as without groups, more bytes (``wire_bytes()`` counts them, a warning names
the tensors once). PyTorch's grouped all-reduce (``groups=``/``num_groups``) sends each group
as a bucket (:mod:`~hvd_gradcomp.buckets`, one codec call per route): the payloads are shared
out as one piece per tensor, views of one buffer per payload dtype that Horovod sums in place,
and the group's first ``decompress`` decodes every unit (docs/usage.md, "Grouped all-reduce").

Sparse gradients (PyTorch ``sparse=True`` embeddings without ``sparse_as_dense``, TensorFlow
``IndexedSlices``) never reach ``compress``: Horovod's sparse path gathers their indices and values. The
adapter notices them (PyTorch: in ``decompress``; TensorFlow: in the same ``allreduce_grads``
call), logs a warning naming the tensor once, and counts their bytes in
``bytes_per_step().sparse`` and ``metrics()``.
"""
import dataclasses
import logging
from typing import Any, NamedTuple

from . import composite
from .base import (HALF_MAX, EmptyState, Scheme, TensorInfo, compress_tensor, finish_tensor, passes_through,
                   saturate_output)
from .buckets import Buckets
from .checkpoint import Checkpoints
from .link import LinkCalibration
from .primitives import FLOAT_DTYPES, itemsize
from .horovod_ops import group_dtype, horovod_nccl_avg
from .records import TensorRecords
from .routing import RouteTable, Routing, with_min_numel

__all__ = ["HorovodCompressor", "Call"]

log = logging.getLogger("hvd_gradcomp")


class Call(NamedTuple):
    """What the adapters learn from Horovod's calling frame about one compress call.

    key: Horovod's name for the tensor (parameter name, variable position, ``name=``), or None.
    op: ``"sum" "average" "adasum" "min" "max" "product"``, or None when unknown.
    prescale, postscale: the factors Horovod will multiply the payload by before and after the
        reduction (``gradient_predivide_factor`` f gives 1/f and f under Average); 1.0 when none.
    process_set: the framework's process set of the all-reduce, or None for the global one.
    owner: what the key belongs to, stable across steps: the PyTorch optimizer, or the
        TensorFlow variable; a second owner under the same key gets its own state
        (``key@1``, ``key@2``, ... in order of first use), or None.
    filled_in: True when Horovod's ``synchronize()`` is filling in a gradient this rank never
        computed (an unused parameter): its collectives run in an order that differs between
        ranks.
    shape: the static shape of the tensor's variable, when the gradient's own shape has
        unknown dimensions (TensorFlow ``sparse_as_dense``); None otherwise.
    label: the name routing rules match (:mod:`~hvd_gradcomp.routing`); None: ``key``.
    pin: TensorFlow: the variable's ``ref()``, under which ``route()`` stored the decision
        (variable names may differ between ranks); None: decide from ``label``.
    group: TensorFlow ``grouped_allreduce``: the list of the group's tensors (one collective,
        one dtype); None otherwise.
    batch: TensorFlow ``allreduce_grads``: its ``(grads, vars)``, where sparse gradients
        (``IndexedSlices``, which bypass compress) are found; None otherwise.
    bucket: PyTorch ``hvd.DistributedOptimizer(groups=...)``: the group's ``(key, gradient)``
        pairs in Horovod's order (one grouped all-reduce), compressed as one bucket
        (:mod:`~hvd_gradcomp.buckets`); None otherwise.
    """

    key: Any = None
    op: Any = None
    prescale: float = 1.0
    postscale: float = 1.0
    process_set: Any = None
    owner: Any = None
    filled_in: bool = False
    shape: Any = None
    label: Any = None
    pin: Any = None
    group: Any = None
    batch: Any = None
    bucket: Any = None


class _Piece(NamedTuple):
    """The ctx of one tensor of a PyTorch grouped all-reduce sent as a bucket: its share of the
    bucket's payloads (``index`` in the batch's pieces) and the batch."""

    index: int
    batch: Any  # _GroupBatch


class _GroupBatch:
    """One grouped all-reduce's bucket: the plan, each unit's ctx, the payload buffers (one per
    dtype) that the members' pieces are views of, and the decoded gradients once decoded."""

    __slots__ = ("plan", "ctxs", "spans", "pieces", "outs", "left")

    def __init__(self, plan, ctxs, spans, pieces):
        self.plan, self.ctxs, self.spans, self.pieces = plan, ctxs, spans, pieces
        self.outs, self.left = None, len(pieces)


class _AdapterCtx(NamedTuple):
    """What ``decompress`` needs of one compress call."""

    info: TensorInfo
    inner: Any  # the scheme's ctx
    scale: Any  # the loss scale divided out (0-d float32 tensor), or None
    scheme: Scheme  # the route's scheme


class _Cast(NamedTuple):
    """A payload widened for a TensorFlow group: cast the reduced one back to ``dtype`` first."""

    dtype: str
    inner: Any  # _AdapterCtx, or None for a tensor that passed through


def scheme_info(info: TensorInfo, scale) -> TensorInfo:
    """The :class:`TensorInfo` the scheme works under: with a loss ``scale`` (not None) the
    gradient is divided by it in float32, so ``info`` as float32; else ``info`` itself."""
    return info if scale is None or info.dtype == "float32" else dataclasses.replace(info, dtype="float32")


class HorovodCompressor(Buckets, TensorRecords, Checkpoints, LinkCalibration):
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
        "__weakref__",
    )
    ops = None  # the backend's Primitives (class attribute of the subclass)

    def __init__(self, routing):
        """Args: routing: a :class:`~hvd_gradcomp.routing.Routing`, or one scheme (all tensors
        to it, those below its ``min_numel`` as fp16, as :meth:`Routing.single`)."""
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
            return self._compress_grouped(tensor, call)
        if call.bucket is not None and len(call.bucket) > 1:
            done = self._compress_bucket(tensor, call)
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

    # ---- the engine-neutral entry points (DDP, FSDP, update sync: any engine but Horovod's) ----
    def bind_engine(self, engine):
        """Use ``engine``'s collectives outside compress instead of Horovod's.

        Args:
            engine: an object with ``world() -> (size, rank)``, ``gather(obj) -> [obj of rank
                0, 1, ...]`` and ``allreduce(x, average) -> tensor`` (blocking), e.g.
                ``torch_backend.engine.ProcessGroupEngine(group)``. The world size and rank of
                every tensor, ``state_dict(gather=True)``, the route check and ``calibrate()``
                then follow it.

        Returns self. Raises ValueError if another engine is already bound (a compressor
        belongs to one training run: its state is kept per tensor key).
        """
        if self._engine is not None and self._engine is not engine:
            raise ValueError(f"compressor {self.spec!r} is already bound to {self._engine!r}; each "
                             f"model needs its own compressor (its state is kept per tensor key)")
        self._engine = engine
        return self

    @property
    def engine(self):
        """The engine bound by :meth:`bind_engine`, or None (Horovod's collectives)."""
        return self._engine

    def encode(self, tensor, key: str, op: str = "sum", group=None, label=None):
        """Compress one gradient under an explicit key, for an engine that posts the all-reduce
        itself (no Horovod calling frame is read).

        Args:
            tensor: the gradient (any shape, a float dtype; other dtypes and empty tensors are
                returned as their own payload with ctx None).
            key: its stable identity, equal on every rank (a parameter name, a shard's path).
            op: ``"sum"`` or ``"average"``: how the engine combines the ranks' payloads.
            group: the engine's process group (recorded in the tensor's info; not its identity).
            label: the name routing rules match (default ``key``).

        Returns ``(payload, ctx)``: the engine all-reduces ``payload`` (in its dtype, elementwise,
        with ``op``) and hands the result to :meth:`decode` with ``ctx``. Posts no collective.

        Raises:
            ValueError: what :meth:`compress` refuses (a shape change under one key, a route
                that differs from a loaded checkpoint's, ...), before any collective.
        """
        if op not in ("sum", "average"):
            raise ValueError(f"{self.spec}: encode({key!r}): op must be 'sum' or 'average', got {op!r}")
        if self._is_sparse(tensor):
            raise ValueError(f"{self.spec}: tensor {key!r} has a sparse gradient; all-reduce it "
                             f"uncompressed (or make it dense) instead of encoding it")
        payload, ctx, _ = self._compress_one(tensor, Call(key=key, op=op, process_set=group,
                                                          label=label if label is not None else key))
        return payload, ctx

    def decode(self, payload, ctx, divide=None):
        """The all-reduced ``payload`` of :meth:`encode` mapped back; the tensor's state moves on.

        Args:
            payload: the all-reduced payload (same shape and dtype as encode returned).
            ctx: encode's ctx.
            divide: None: the sum (op ``"sum"``) or mean (``"average"``) in the gradient's dtype,
                as :meth:`decompress`. A number n: the decoded value divided by n in float32
                before the cast to the gradient's dtype (DDP's mean of a sum), so a float16
                gradient's mean is never formed from an overflowing float16 sum; a finite value
                beyond a half dtype's range is clamped and the excess kept in error feedback.
        """
        if divide is None:
            return self.decompress(payload, ctx)
        if ctx is None:
            return payload / divide
        info, inner, scale, scheme = ctx
        sinfo = scheme_info(info, scale)
        has_state = self._has_state(info.key)
        state = self._read_state(info.key) if has_state else EmptyState()
        out, new_state = finish_tensor(scheme, self.ops, payload, inner, state, sinfo, dtype="float32")
        out = out * (1.0 / divide)
        if info.dtype in HALF_MAX:  # clamp the mean: each rank keeps the excess (Average's share)
            out, new_state = saturate_output(scheme, self.ops, out, new_state,
                                             dataclasses.replace(sinfo, op="average"), HALF_MAX[info.dtype], scale)
        if scale is not None:
            out = out * scale
        if info.dtype != "float32":
            out = self.ops.cast(out, info.dtype)
        if has_state and new_state is not state:
            self._write_state(info.key, new_state)
        return out

    def linear_decode(self, ctx):
        """The factor ``f`` when decoding ``ctx``'s payload is its float32 cast times ``f`` and
        moves no state (the casts, without a loss scale), so an engine may fuse the cast, the
        scaling and the write into its own buffer; else None."""
        if ctx is None or ctx.scale is not None or self._has_state(ctx.info.key):
            return None
        return composite.decode_factor(ctx.scheme, scheme_info(ctx.info, ctx.scale))

    def decode_joined(self, payload, ctx):
        """The state step of a rank that contributed zeros (DDP's ``Join``): the fields every
        rank agrees on move on from the all-reduced ``payload``, this rank's own fields
        (:attr:`~hvd_gradcomp.base.Scheme.rank_local_fields`: its error feedback) stay as they
        were. Nothing is returned (the joined rank has no gradient to write)."""
        if ctx is None or not self._has_state(ctx.info.key):  # passed through, or stateless
            return
        info, inner, scale, scheme = ctx
        info = scheme_info(info, scale)
        old = self._read_state(info.key)
        _, new = finish_tensor(scheme, self.ops, payload, inner, old, info)
        if new is old:
            return
        local = [f for f in scheme.rank_local_fields if f in new._fields]
        if tuple(new._fields) == tuple(old._fields) and all(
                tuple(self.ops.shape(getattr(old, f))) == tuple(self.ops.shape(getattr(new, f))) for f in local):
            new = new._replace(**{f: getattr(old, f) for f in local})
        else:  # an adaptive scheme changed the tensor's scheme on the agreed figures
            new = new._replace(**{f: 0.0 * getattr(new, f) for f in local})
            if ("joined", info.key) not in self._warned:  # once per tensor and compressor
                self._warned.add(("joined", info.key))
                log.warning("hvd_gradcomp: %s changed scheme while this rank had joined; its pending "
                            "error feedback on this rank is dropped", info.key)
        self._write_state(info.key, new)

    def _compress_grouped(self, tensor, call: Call):
        """A member of a TensorFlow grouped all-reduce: the whole group is compressed at its
        first member, with one payload dtype (module docstring); the others are returned as
        Horovod asks for them."""
        group = call.group
        if self._group is not None and self._group[0] is group:
            done = self._group[1].pop(id(tensor), None)
            if done is not None:
                if not self._group[1]:
                    self._group = None
                return done
        results, keys = {}, {}
        for member in group:
            if id(member) in results:
                continue
            member_call = call if member is tensor else self._find_call(member)
            payload, ctx, key = self._compress_one(member, member_call)
            results[id(member)], keys[id(member)] = (payload, ctx), key
        dtypes = {i: self.ops.dtype(p) for i, (p, _) in results.items()}
        try:
            common = group_dtype(dtypes.values())
        except ValueError as e:
            raise ValueError(f"{self.spec}: grouped all-reduce of "
                             f"{[keys[i] for i in results]}: {e}; use groups=None") from None
        if common is not None:
            extra = 0
            for i, (payload, ctx) in list(results.items()):
                if dtypes[i] == common:
                    continue
                results[i] = (self.ops.cast(payload, common), _Cast(dtypes[i], ctx))
                key = keys[i]
                if key is not None and key in self._wire:
                    w = self._wire[key]
                    wide = w.payload * itemsize(common) // itemsize(dtypes[i])
                    extra += wide - w.payload
                    self._wire[key] = w._replace(payload=wide)
            members = tuple(sorted((str(keys[i]), dtypes[i]) for i in results))
            if members not in self._warned:
                self._warned.add(members)
                hint = ("route the group's small tensors to thc as well ('thc:min_numel=1')"
                        if "int32" in dtypes.values() else "route a group's tensors to schemes of one "
                        "payload dtype")
                log.warning("hvd_gradcomp: TensorFlow grouped all-reduce of %s: Horovod's grouped "
                            "all-reduce takes one dtype, so these payloads travel as %s (exact; %d more "
                            "bytes per step). To avoid it, %s, or use groups lists that keep them apart.",
                            ", ".join(f"{k} ({d})" for k, d in members), common, extra, hint)
        mine = results.pop(id(tensor))
        self._group = (group, results) if results else None
        return mine
    def _compress_bucket(self, tensor, call: Call):
        """A member of a PyTorch grouped all-reduce (``groups=``/``num_groups``): at the first
        member the whole group is compressed as one bucket (one codec call per route,
        :mod:`~hvd_gradcomp.buckets`) and its payloads are shared out as one piece per member
        (views of one buffer per payload dtype, which Horovod's in-place grouped all-reduce
        sums); the others get their piece. None when the group cannot go as a bucket (mixed
        dtypes, a gradient that is not a float tensor): then each member is compressed alone."""
        ops = self.ops
        if self._pieces is not None:
            done = self._pieces.pop(id(tensor), None)
            if done is not None:
                return done
        grads = [g for _, g in call.bucket]
        dtypes = {ops.dtype(g) for g in grads}
        if len(dtypes) != 1 or next(iter(dtypes)) not in FLOAT_DTYPES or \
                any(self._is_sparse(g) for g in grads) or all(g is not tensor for g in grads):
            return None
        from .buckets import Member
        dtype = dtypes.pop()
        members, offset = [], 0
        for (name, g) in call.bucket:
            key = self._key(Call(key=name, owner=call.owner))
            shape = tuple(ops.shape(g))
            numel = 1
            for s in shape:
                numel *= s
            members.append(Member(key, name, shape, offset, numel))
            offset += numel
        flat = ops.concat([ops.reshape(self._detach(g), (-1,)) for g in grads], 0)
        plan = self.plan_bucket(members, dtype, call.op if call.op in ("sum", "average") else None,
                                call.process_set, flat)
        for unit in plan.units:  # what Horovod would do to each payload, as for one tensor
            self._check_call(unit.scheme, unit.key, call, unit.info)
        encoded = [self.encode_unit(unit, flat[unit.start:unit.stop] if unit.contiguous
                                    else ops.gather(flat, unit.index)) for unit in plan.units]
        by_dtype = {}
        for i, (payload, _) in enumerate(encoded):
            by_dtype.setdefault(ops.dtype(payload), []).append(i)
        buffers, spans = [], []  # spans: per unit (buffer, offset, numel, shape)
        for d in sorted(by_dtype):
            parts = [ops.reshape(encoded[i][0], (-1,)) for i in by_dtype[d]]
            buf = parts[0] if len(parts) == 1 else ops.concat(parts, 0)
            at = 0
            for i in by_dtype[d]:
                n = 1
                for s in ops.shape(encoded[i][0]):
                    n *= s
                spans.append((i, len(buffers), at, n, tuple(ops.shape(encoded[i][0]))))
                at += n
            buffers.append(buf)
        spans = [s[1:] for s in sorted(spans)]
        sizes = [ops.shape(b)[0] for b in buffers]
        if len(grads) < len(buffers) or sum(sizes) < len(grads):
            return None  # (a tiny group: fewer elements than members) compressed one by one
        # one piece per member: every buffer one, the rest cut from the largest
        counts = [1] * len(buffers)
        counts[sizes.index(max(sizes))] += len(grads) - len(buffers)
        if max(sizes) < counts[sizes.index(max(sizes))]:
            return None
        pieces = []
        for buf, size, k in zip(buffers, sizes, counts):
            bounds = [size * j // k for j in range(k + 1)]
            pieces.extend(buf[bounds[j]:bounds[j + 1]] for j in range(k))
        batch = _GroupBatch(plan, [c for _, c in encoded], (buffers, spans), pieces)
        results = {id(g): (piece, _Piece(j, batch)) for j, (g, piece) in enumerate(zip(grads, pieces))}
        mine = results.pop(id(tensor))
        self._pieces = results or None
        return mine

    def _decompress_piece(self, payload, ctx: "_Piece"):
        """A grouped member's decoded gradient: at the batch's first decompress every unit is
        decoded from the summed buffers (Horovod's grouped all-reduce sums the pieces in place,
        so the buffers hold every member's sum by then)."""
        batch = ctx.batch
        if payload is not batch.pieces[ctx.index]:
            raise RuntimeError(f"{self.spec}: a grouped all-reduce returned a new tensor for piece "
                               f"{ctx.index} instead of summing it in place (Horovod's "
                               f"grouped_allreduce_async_ does); the bucket cannot be decoded")
        if batch.outs is None:
            ops, plan = self.ops, batch.plan
            buffers, spans = batch.spans
            outs = []
            for uctx, (b, at, n, shape) in zip(batch.ctxs, spans):
                outs.append(ops.reshape(self.decompress(ops.reshape(buffers[b][at:at + n], shape), uctx), (-1,)))
            if all(u.contiguous for u in plan.units):  # the units partition the flat vector
                order = sorted(range(len(outs)), key=lambda i: plan.units[i].start)
                full = outs[order[0]] if len(order) == 1 else ops.concat([outs[i] for i in order], 0)
            else:
                total = plan.members[-1].offset + plan.members[-1].numel
                full = ops.zeros((total,), plan.dtype, outs[0])
                for unit, out in zip(plan.units, outs):
                    index = unit.index if not unit.contiguous else ops.arange(unit.stop - unit.start, "int64", out) + unit.start
                    full = ops.index_add(full, index, out)
            batch.outs = [ops.reshape(full[m.offset:m.offset + m.numel], m.shape) for m in plan.members]
        batch.left -= 1
        out = batch.outs[ctx.index]
        if batch.left == 0:
            batch.outs = batch.pieces = None
        return out

    def decompress(self, payload, ctx):
        """The all-reduced payload mapped back to the gradient's shape and dtype; the tensor's
        state moves on (or stays, if the payload says some rank failed this step)."""
        if isinstance(ctx, _Piece):
            return self._decompress_piece(payload, ctx)
        if isinstance(ctx, _Cast):
            payload = self.ops.cast(payload, ctx.dtype)
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
