"""Framework-neutral half of the Horovod compressor objects (``Compression.<name>(...)``).

Horovod calls ``compress(tensor) -> (payload, ctx)`` and ``decompress(payload, ctx)`` and
passes no name, step or op. This class keeps, per tensor key, the scheme's state and the
static facts (shape, dtype, bytes on the wire); the backend subclasses supply the primitives,
what Horovod's calling frame says about the call (:class:`Call`: the tensor's key, op, scale
factors, process set, owner), and state storage (plain tensors in PyTorch, ``tf.Variable``s
in TensorFlow). Before anything is computed it refuses, on every rank, what the scheme
cannot take (an op, a scale factor, a blocking variant on a gradient Horovod fills in).

Each instance belongs to one training run. A second optimizer (or, in TensorFlow, another
variable at the same gradient position) using the same instance gets its own state.

Which scheme sends a tensor is decided once, the first time the compressor sees it, by its
:class:`~hvd_gradcomp.routing.Routing` (rules on names and sizes, a default scheme, fp16 below
``min_numel``), and kept with the tensor's state; checkpoints record it.

TensorFlow's grouped all-reduce (``num_groups``/``groups``) sends a group in one collective,
which takes one dtype (``HorovodGroupedAllreduce`` has one type attribute), while a group may
hold payloads of several (THC's int32 words, fp16 for small tensors, PowerSGD's float32
factors). At the first member's ``compress`` the adapter compresses the whole group (Horovod's
frame holds it), and if the payload dtypes differ it casts each to the narrowest dtype that
holds every member's values and sums exactly (float16 + float32: float32; with int32 or
float64: float64), and back before ``decompress``: one collective per group as Horovod meant,
the same numbers as without groups, more bytes (``wire_bytes()`` counts them, a warning names
the tensors once). PyTorch's grouped all-reduce takes mixed dtypes as they are.

Sparse gradients (PyTorch ``sparse=True`` embeddings without ``sparse_as_dense``, TensorFlow
``IndexedSlices``) never reach ``compress``: Horovod's sparse path gathers their indices and values. The
adapter notices them (PyTorch: in ``decompress``; TensorFlow: in the same ``allreduce_grads``
call), logs a warning naming the tensor once, and counts their bytes in
``bytes_per_step().sparse`` and ``metrics()``.
"""
import dataclasses
import logging
from typing import Any, NamedTuple

from .registry import SCHEMES, make_scheme
from .base import (EmptyState, Scheme, StepBytes, TensorInfo, check_state, compress_tensor,
                   finish_tensor, passes_through)
from .primitives import FLOAT_DTYPES, itemsize
from .routing import Route, Routing, canonical_text

__all__ = ["HorovodCompressor", "Namespace", "Factory", "Call", "op_name", "group_dtype"]

log = logging.getLogger("hvd_gradcomp")

_NEEDS_ROUTE = ("{spec!r}: rules match variable names, which TensorFlow does not keep equal across "
                "ranks (Keras numbers layers per process); call compressor.route(variables) on every "
                "rank before the first step, so the ranks' routes are compared once; variable "
                "{name!r} (gradient {key!r}) was not given to route()")
_ROUTE_MISMATCH = ("{spec!r}: tensor {key!r} was routed to {saved!r} in the checkpoint, and this "
                   "compressor routes it to {now!r} ({why}); load the checkpoint into a compressor "
                   "whose rules route it alike")
_SPARSE_WARNING = ("hvd_gradcomp: {name} has a sparse gradient (PyTorch sparse=True / TensorFlow "
                   "IndexedSlices): Horovod's sparse path sends its indices and values uncompressed, around "
                   "the compressor {spec!r}; bytes_per_step().sparse counts them. Pass "
                   "sparse_as_dense=True to Horovod's optimizer to compress it (as a dense gradient "
                   "of the full table)")


def group_dtype(dtypes):
    """The payload dtype a TensorFlow grouped all-reduce of payloads of ``dtypes`` uses.

    None when they are all one dtype (nothing to do). float16 and float32 -> float32 (every
    float16 is a float32, and the sum is at least as exact). With int32 or float64 -> float64:
    its 53-bit mantissa holds every float32 and int32 value and their sums over ranks exactly
    (THC's words are non-negative with sums below 2**31), and Horovod's Average of a float64
    word, ``W * (1/n)``, truncated back to int32, is what it computes for an int32 word.

    Raises:
        ValueError: a mix no dtype holds exactly (e.g. int64 with floats).
    """
    dtypes = set(dtypes)
    if len(dtypes) <= 1:
        return None
    if dtypes <= {"float16", "float32"}:
        return "float32"
    if dtypes <= {"float16", "float32", "float64", "int32"}:
        return "float64"
    raise ValueError(f"no payload dtype holds payloads of dtypes {sorted(dtypes)} exactly")


def op_name(hvd, op, average=None) -> str:
    """Horovod's op constant ``op`` (or the deprecated ``average`` flag when ``op`` is None) as
    a lower-case name: ``"average" "sum" "adasum" "min" "max" "product"``; ``hvd`` is the
    framework's Horovod module."""
    if op is None:
        return "average" if average is None or average else "sum"
    for name in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
        if getattr(hvd, name, object()) == op:
            return name.lower()
    return str(op)


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


class _Ctx(NamedTuple):
    """What ``decompress`` needs of one compress call."""

    info: TensorInfo
    inner: Any  # the scheme's ctx
    scale: Any  # the loss scale divided out (0-d float32 tensor), or None
    scheme: Scheme  # the route's scheme


class _Cast(NamedTuple):
    """A payload widened for a TensorFlow group: cast the reduced one back to ``dtype`` first."""

    dtype: str
    inner: Any  # _Ctx, or None for a tensor that passed through


class HorovodCompressor:
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
        routing: the :class:`~hvd_gradcomp.routing.Routing`.
    """

    __slots__ = (
        # configuration: the routing, and its default scheme
        "routing", "scheme",
        # per-tensor bookkeeping, keyed by the tensor's stable identity
        "_infos", "_wire", "_routes",
        # states and routes loaded by load_state_dict() before the tensor was first seen
        "_pending", "_pending_routes",
        # per key, the owners seen (optimizers, variables), in order of first use
        "_owners",
        # TensorFlow: routes fixed by route(), by variable
        "_pins",
        # sparse gradients seen: key -> backend entry of (bytes last step, steps)
        "_sparse",
        # TensorFlow grouped all-reduce: (group list, {id(tensor): (payload, ctx)}) not yet returned
        "_group",
        # warnings already given (group compositions)
        "_warned",
        # loss scale source (GradScaler / LossScaleOptimizer), see set_loss_scale()
        "_scale_source",
        "__weakref__",
    )
    ops = None  # the backend's Primitives (class attribute of the subclass)

    def __init__(self, routing):
        """Args: routing: a :class:`~hvd_gradcomp.routing.Routing`, or one scheme (all tensors
        to it, those below :func:`~hvd_gradcomp.registry.small_default` of its name as fp16,
        as :meth:`Routing.single`)."""
        if isinstance(routing, Scheme):
            routing = Routing.single(routing)
        self.routing = routing.bind(self.ops)
        self.scheme = self.routing.default
        self._infos = {}
        self._wire = {}
        self._routes = {}
        self._pending = {}
        self._pending_routes = {}
        self._owners = {}
        self._pins = {}
        self._sparse = {}
        self._group = None
        self._warned = set()
        self._scale_source = None
        if any(s.adaptive and s.link is None for s in self.routing.schemes()) and \
                self._global_world()[0] is not None:
            self.calibrate()  # auto without a given link: measure it now, on every rank

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

    def _world(self, process_set):
        """(world_size, rank) of the all-reduce: the process set's, or the global ones."""
        hvd = self._horovod()
        if process_set is None or getattr(process_set, "process_set_id", 0) == 0:
            return hvd.size(), hvd.rank()
        return process_set.size(), process_set.rank()

    def _global_world(self):
        """(size, rank) of Horovod's global set, or (None, None) before ``hvd.init()``."""
        try:
            return self._world(None)
        except ValueError:  # Horovod: "Horovod has not been initialized; use hvd.init()."
            return None, None

    def _read_state(self, key):
        raise NotImplementedError

    def _write_state(self, key, state):
        raise NotImplementedError

    def _create_state(self, key, state):
        """Store a tensor's first state (TensorFlow makes variables here); default: write it."""
        self._write_state(key, state)

    def _has_state(self, key) -> bool:
        raise NotImplementedError

    def _export(self, tensor, portable=False):
        """A host-side copy of a state tensor for state_dict(); ``portable``: an object that
        pickles without the framework's graph or device (for ``gather=True``)."""
        raise NotImplementedError

    def _zeros_like(self, value):
        """Zeros of a saved state value's shape and dtype (a reset residual)."""
        raise NotImplementedError

    def _import(self, value):
        """A saved state value (a tensor, or a NumPy array from a gathered state) as a host
        tensor of the framework."""
        raise NotImplementedError

    def _route_items(self, params):
        """``(name, shape tuple, dtype string, pin)`` per parameter given to :meth:`route`."""
        raise NotImplementedError

    def _is_sparse(self, tensor) -> bool:
        """True for a sparse gradient handed to compress (PyTorch ``groups=``); default False."""
        return False

    def _watch_sparse(self, call: Call):
        """Note the sparse gradients of ``call.batch`` (TensorFlow); default: nothing."""

    def _uncompressed(self, payload):
        """Called by decompress for a payload compress never saw (PyTorch notes sparse ones)."""

    def _read_sparse(self, entry):
        """(bytes last step, steps) of a sparse-gradient entry, as Python ints."""
        return int(entry[0]), int(entry[1])

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

    def _key(self, call: Call):
        """The state key of a call: Horovod's name, kept apart per optimizer/tape; None
        without a name."""
        key = call.key
        if key is None:
            return None
        if call.owner is not None:
            owners = self._owners.setdefault(key, [])
            for i, owner in enumerate(owners):
                if owner is call.owner:
                    break
            else:
                i = len(owners)
                owners.append(call.owner)
            if i:
                key = f"{key}@{i}"
        return key

    def _route(self, key, call: Call, numel: int) -> Route:
        """The tensor's route: decided at its first compress, then the same at every step."""
        route = self._routes.get(key) if key is not None else None
        if route is not None:
            return route
        if call.pin is not None and self.routing.needs_names():
            route = self._pins.get(call.pin)
            if route is None:
                raise ValueError(_NEEDS_ROUTE.format(spec=self.spec, name=call.label, key=key))
        else:
            route = self.routing.decide(call.label if call.label is not None else call.key, numel)
        if key is not None:
            saved = self._pending_routes.pop(key, None)
            if saved is not None and saved != route.text:
                raise ValueError(_ROUTE_MISMATCH.format(spec=self.spec, key=key, saved=saved,
                                                        now=route.text, why=route.why))
            self._routes[key] = route
        return route

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
        if call.filled_in and s.blocks(info):
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
        route = self._route(key, call, numel)
        scheme = route.scheme
        if key is None:
            if type(scheme).init is not Scheme.init:
                raise ValueError(self.no_key_message.format(scheme=scheme.name))
            key = "<unnamed>"  # stateless: any key will do
        world_size, rank = self._world(call.process_set)
        op = call.op if call.op in ("sum", "average") else None
        info = TensorInfo(key, shape, dtype, world_size, rank, op, call.process_set)
        self._check_call(scheme, key, call, info)
        known = self._infos.get(key)
        if known is not None and (known.shape, known.dtype) != (shape, dtype):
            raise ValueError(f"{scheme.name}: tensor {key!r} was {known.dtype}{list(known.shape)} "
                             f"in earlier steps, got {dtype}{list(shape)}; one key, one shape")
        if known != info or scheme.adaptive:  # static per tensor, except for adaptive schemes
            self._wire[key] = scheme.wire(info)
        self._infos[key] = info
        if scheme.identity:
            return tensor, None, key
        tensor = self._detach(tensor)
        scale = None
        if self._scale_source is not None:
            scale = self._scale_of(self._scale_source)
            tensor = ops.cast(tensor, "float32") * (1.0 / scale)
            info_x = info if info.dtype == "float32" else dataclasses.replace(info, dtype="float32")
        else:
            info_x = info
        state = self._state_for(scheme, info, tensor)
        payload, ctx = compress_tensor(scheme, ops, tensor, state, info_x)
        return payload, _Ctx(info, ctx, scale, scheme), key

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

    def decompress(self, payload, ctx):
        """The all-reduced payload mapped back to the gradient's shape and dtype; the tensor's
        state moves on (or stays, if the payload says some rank failed this step)."""
        if isinstance(ctx, _Cast):
            payload = self.ops.cast(payload, ctx.dtype)
            ctx = ctx.inner
        if ctx is None:
            self._uncompressed(payload)
            return payload
        info, scheme_ctx, scale, scheme = ctx
        has_state = self._has_state(info.key)
        state = self._read_state(info.key) if has_state else EmptyState()
        if scale is None:
            out, new_state = finish_tensor(scheme, self.ops, payload, scheme_ctx, state, info)
        else:
            info_x = info if info.dtype == "float32" else dataclasses.replace(info, dtype="float32")
            out, new_state = finish_tensor(scheme, self.ops, payload, scheme_ctx, state, info_x)
            out = out * scale
            if info.dtype != "float32":
                out = self.ops.cast(out, info.dtype)
        if has_state and new_state is not state:
            self._write_state(info.key, new_state)
        return out

    def _state_for(self, scheme, info, like):
        """The state under info.key: existing, loaded, or freshly initialised; checked."""
        if self._has_state(info.key):
            return self._read_state(info.key)
        fresh = self._initial_state(scheme, info, like, self._pending.pop(info.key, None))
        if len(fresh):
            self._create_state(info.key, fresh)
            return self._read_state(info.key)
        return fresh

    def _to_device(self, value, like):
        return value

    def _initial_state(self, scheme, info, like, loaded):
        """``scheme``'s initial state for a tensor, or ``loaded`` checked against it.

        TensorFlow overrides this to build it outside any graph (it becomes tf.Variables).
        """
        if loaded is None:
            return scheme.init(self.ops, info, like)
        fresh = scheme.init_like(self.ops, info, like, loaded)
        scheme.forget(info.key)
        self._check_loaded(scheme, info.key, loaded, fresh)
        return type(fresh)(*[self.ops.cast(self._to_device(v, like), self.ops.dtype(f))
                             for v, f in zip(loaded, fresh)])

    def _check_loaded(self, scheme, key, loaded, fresh):
        scheme.check_loaded(key, loaded)
        check_state(loaded, fresh, key)
        for field, a, b in zip(fresh._fields, loaded, fresh):
            if tuple(self.ops.shape(a)) != tuple(self.ops.shape(b)):
                raise ValueError(f"{scheme.name}: loaded state for tensor {key!r} has "
                                 f"{field} of shape {list(self.ops.shape(a))}, expected "
                                 f"{list(self.ops.shape(b))}")

    # ---- the link, for auto ----
    def calibrate(self, process_set=None, sizes=(1 << 10, 1 << 21), repeats: int = 3, like=None):
        """Measure the link for this compressor's ``auto`` schemes (:mod:`hvd_gradcomp.auto`).

        A collective outside compress: every rank of ``process_set`` calls it at the same
        point (the compressor's constructor does when ``auto`` has no ``bandwidth_gbit`` and
        Horovod is initialised; call it again to refresh the figures).

        Each size (float32 coordinates) is all-reduced ``repeats + 1`` times (the first is not
        timed); from the median seconds ``t1, t2`` of the two sizes and the ring's bytes per
        rank ``w1, w2`` (:func:`hvd_gradcomp.ring.ring_wire_bytes`): rate ``(w2 - w1) / (t2 -
        t1)`` bytes/s and latency ``t1 - w1 / rate`` s (>= 0); the large size once more as
        float16 gives the float16 rate (Gloo sums float16 in scalar code on CPUs). All three are
        averaged over the ranks by one more all-reduce, so every rank holds the same
        :class:`~hvd_gradcomp.auto.Link`.
        Then each ``auto`` scheme times its candidates' codecs on a reference matrix
        (:meth:`~hvd_gradcomp.auto.AutoScheme.reference_costs`), averaged over the ranks by one
        all-reduce each: the start of its tensors (:func:`~hvd_gradcomp.auto.start_choice`).

        Args:
            process_set: the framework's process set of the gradients' all-reduces (None: global).
            sizes: two sizes, coordinates, small then large (default 4 KiB and 8 MiB).
            repeats: timed all-reduces per size (>= 1).
            like: a tensor on the device the gradients live on (default: the framework's
                default device; a CUDA tensor measures NCCL's path and times the ``auto``
                candidates' codecs on the GPU: on a GPU job built before its tensors exist,
                call ``calibrate(like=...)`` again with one).

        Returns:
            The :class:`~hvd_gradcomp.auto.Link`, also given to every ``auto`` scheme.
        """
        import math
        import time
        from .auto import Link
        from .ring import ring_wire_bytes
        hvd = self._horovod()
        size, _ = self._world(process_set)
        kwargs = {} if process_set is None else {"process_set": process_set}
        if size <= 1:
            link = Link(math.inf, 0.0)  # one rank: nothing crosses a link
        else:
            seconds = []
            for n, dtype in ((sizes[0], "float32"), (sizes[1], "float32"), (sizes[1], "float16")):
                x = self.ops.zeros((n,), dtype, like)
                runs = []
                for i in range(repeats + 1):
                    start = time.perf_counter()
                    y = hvd.allreduce(x, op=hvd.Sum, name=f"hvd_gradcomp.calibrate.{n}.{dtype}", **kwargs)
                    self.ops.to_host(self.ops.sum(self.ops.cast(y[:1], "float32"), None))
                    if i:
                        runs.append(time.perf_counter() - start)
                seconds.append(sorted(runs)[len(runs) // 2])
            w1, w2, w16 = ring_wire_bytes(4 * sizes[0], size), ring_wire_bytes(4 * sizes[1], size), \
                ring_wire_bytes(2 * sizes[1], size)
            rate = (w2 - w1) / max(seconds[1] - seconds[0], 1e-9)
            latency = max(seconds[0] - w1 / rate, 0.0)
            rate16 = w16 / max(seconds[2] - latency, 1e-9)
            agreed = hvd.allreduce(self.ops.constant([rate, latency, rate16], "float64", like),
                                   op=hvd.Average, name="hvd_gradcomp.calibrate.link", **kwargs)
            link = Link(*self.ops.to_host(agreed))
            if self._world(None)[1] == 0:
                log.info("hvd_gradcomp auto: link measured over %d ranks: %.1f MB/s (float16 "
                         "payloads %.1f MB/s), %.3f ms per all-reduce", size,
                         link.bytes_per_second / 1e6, link.fp16_bytes_per_second / 1e6,
                         link.latency_s * 1e3)
        for i, scheme in enumerate(self.routing.schemes()):
            if not scheme.adaptive:
                continue
            costs = None
            if size > 1:  # each candidate's codec on the reference matrix, the ranks' mean
                costs = self.ops.to_host(hvd.allreduce(
                    self.ops.constant(scheme.reference_costs(self.ops, like), "float64", like),
                    op=hvd.Average, name=f"hvd_gradcomp.calibrate.codecs.{i}", **kwargs))
            scheme.set_link(link, costs)
        return link

    # ---- routing ----
    def route(self, params, check: bool = True) -> list:
        """Decide each parameter's route now, and check that every rank decides alike.

        Needed in TensorFlow when rules match names (variable names may differ between ranks,
        see :mod:`~hvd_gradcomp.routing`): call it on every rank once the model's variables
        exist, before the first step. In PyTorch the routes follow from Horovod's parameter
        names, equal on every rank; ``route()`` then only shows and checks them.

        Args:
            params: PyTorch: ``model.named_parameters()`` (``(name, tensor)`` pairs, the names
                given to ``hvd.DistributedOptimizer``); TensorFlow: ``model.trainable_variables``
                (or ``(name, variable)`` pairs).
            check: compare the ranks' decisions (:meth:`_from_every_rank`: one Horovod
                broadcast per rank; every rank must call ``route()`` then); False decides
                locally, without a collective.

        Returns:
            ``[(name, scheme spec or None), ...]`` in the order given; None for tensors that
            pass through untouched (non-float or empty).

        Raises:
            ValueError, on every rank: the ranks route some parameter differently (naming its
            position and each rank's name and rule), or give different numbers of parameters.
        """
        items = list(self._route_items(params))
        table, routes = [], []
        for name, shape, dtype, _ in items:
            numel = 1
            for s in shape:
                numel *= s
            route = None if passes_through(dtype, numel) else self.routing.decide(name, numel)
            routes.append(route)
            table.append((name, None if route is None else route.text,
                          "passes through" if route is None else route.why))
        if check:
            tables = self._from_every_rank(table, "hvd_gradcomp.route")
            self._check_same_routes(tables)
        for (_, _, _, pin), route in zip(items, routes):
            if pin is not None and route is not None:
                self._pins[pin] = route
        return [(name, text) for name, text, _ in table]

    def _from_every_rank(self, obj, name: str) -> list:
        """``[obj of rank 0, obj of rank 1, ...]`` on every rank (global set), by one
        ``hvd.broadcast_object`` per rank in rank order. Outside compress (route checks and
        checkpoints only); gradient payloads never travel this way."""
        hvd = self._horovod()
        return [hvd.broadcast_object(obj, root_rank=r, name=f"{name}.{r}") for r in range(hvd.size())]

    def _check_same_routes(self, tables):
        """Raise ValueError (the same on every rank: each holds every table) if they differ."""
        count = len(tables[0])
        for r, table in enumerate(tables):
            if len(table) != count:
                raise ValueError(f"{self.spec!r}: route() got {count} parameters on rank 0 and "
                                 f"{len(table)} on rank {r}; every rank must pass the same model's")
        for i in range(count):
            if len({table[i][1] for table in tables}) > 1:
                detail = "; ".join(f"rank {r}: {table[i][0]!r} -> {table[i][1] or 'untouched'} "
                                   f"({table[i][2]})" for r, table in enumerate(tables))
                raise ValueError(f"{self.spec!r}: the ranks route parameter {i} differently ({detail}), "
                                 f"which would pair payloads of different schemes; use rules that "
                                 f"match the same way on every rank's names, or build the model "
                                 f"identically on every rank")

    def routes(self) -> dict:
        """``{key: scheme spec}``: the route of every tensor seen so far."""
        return {key: route.text for key, route in self._routes.items()}

    # ---- checkpoints ----
    def state_dict(self, gather: bool = False) -> dict:
        """The compressor's state for a checkpoint.

        Args:
            gather: False (default): this rank's state, to be saved per rank and loaded on
                the same rank. True: every rank's, collected by :meth:`_from_every_rank` (one
                Horovod broadcast per rank: every rank must call it; each receives every
                rank's state, so memory is world size x residuals), for the usual "save on
                rank 0, load everywhere" habit.

        Returns:
            Per rank: ``{"spec", "tensors": {key: {field: tensor}}, "routes": {key: scheme
            spec}, "rank", "world_size"}`` (host copies). Gathered: ``{"spec", "world_size",
            "ranks": [per-rank dict of rank 0, 1, ...]}`` with values that pickle anywhere
            (PyTorch CPU tensors, NumPy arrays for TensorFlow).
        """
        local = self._local_state(portable=gather)
        if not gather:
            return local
        parts = self._from_every_rank(local, "hvd_gradcomp.state_dict")
        return {"spec": self.spec, "world_size": len(parts), "ranks": list(parts)}

    def _local_state(self, portable: bool) -> dict:
        tensors = {}
        for key in self._infos:
            if self._has_state(key):
                state = self._read_state(key)
                tensors[key] = {f: self._export(v, portable) for f, v in zip(state._fields, state)}
        for key, state in self._pending.items():
            tensors.setdefault(key, {f: v for f, v in zip(state._fields, state)})
        routes = {key: route.text for key, route in self._routes.items()}
        for key, text in self._pending_routes.items():
            routes.setdefault(key, text)
        size, rank = self._global_world()
        return {"spec": self.spec, "tensors": tensors, "routes": routes, "rank": rank, "world_size": size}

    def _same_config(self, spec) -> bool:
        """True if the text ``spec`` describes this compressor's routing, schemes and configs."""
        try:
            return Routing.from_spec(spec).spec() == self.spec
        except (ValueError, TypeError, AttributeError):
            return False

    def load_state_dict(self, state_dict: dict, rank=None):
        """Restore what :meth:`state_dict` returned.

        Args:
            state_dict: per rank, or gathered (``state_dict(gather=True)``, e.g. saved by
                rank 0 and loaded on every rank).
            rank: which saved rank's state to load; default this process's Horovod rank.
                Gathered: that rank's part. Per rank: the dict must be that rank's (a
                per-rank dict of rank 0 loaded on rank 1 would resume rank 1 with rank 0's
                error feedback: refused unless ``rank=0`` is given on purpose).

        A gathered state saved by another number of ranks (elastic) gives every rank rank 0's
        part, with the rank-local fields (:attr:`Scheme.rank_local_fields`: the residuals)
        reset to zero: what the ranks agreed on (THC's ranges, TopKC's scores, PowerSGD's
        bases, step counters) is kept, equal on every rank; the error feedback pending at the
        save is dropped (a warning says so).

        Raises:
            ValueError: the spec differs from this compressor's, the dict is another rank's,
                a tensor's route differs from this compressor's decision, or its state has
                the wrong fields or shapes (checked now for tensors already seen, else at
                their first compress, before any collective).
        """
        if not self._same_config(state_dict.get("spec")):
            raise ValueError(f"state_dict was saved by compressor {state_dict.get('spec')!r}, "
                             f"this one is {self.spec!r}")
        size, me = self._global_world()
        if rank is None:
            rank = me
        if "ranks" in state_dict:
            parts = state_dict["ranks"]
            if size is not None and len(parts) != size:
                log.warning("hvd_gradcomp: state of %d ranks loaded on %d: every rank takes rank 0's, "
                            "with its residuals reset to zero (agreed statistics kept)", len(parts), size)
                self._load_part(parts[0], reset=True)
                return
            if rank is None or not 0 <= rank < len(parts):
                raise ValueError(f"load_state_dict: rank must be in [0, {len(parts)}) for a state "
                                 f"gathered from {len(parts)} ranks, got {rank!r} (is hvd.init() done?)")
            self._load_part(parts[rank], reset=False)
            return
        saved = state_dict.get("rank")
        if saved is not None and rank is not None and saved != rank:
            raise ValueError(f"load_state_dict: this state_dict holds rank {saved}'s state (its "
                             f"error feedback), and this is rank {rank}; save with "
                             f"state_dict(gather=True) to load one file on every rank, or pass "
                             f"rank={saved} to load it here anyway")
        self._load_part(state_dict, reset=False)

    def _load_part(self, part: dict, reset: bool):
        """Load one rank's state (``reset``: zero the rank-local fields)."""
        for key, text in part.get("routes", {}).items():
            text = canonical_text(text)
            route = self._routes.get(key)
            if route is not None and route.text != text:
                raise ValueError(_ROUTE_MISMATCH.format(spec=self.spec, key=key, saved=text,
                                                        now=route.text, why=route.why))
            if route is None:
                self._pending_routes[key] = text
        local = set()
        for scheme in self.routing.schemes():
            local.update(scheme.rank_local_fields)
        for key, fields in part["tensors"].items():
            fields = {f: self._import(v) for f, v in fields.items()}
            if reset:
                fields = {f: self._zeros_like(v) if f in local else v for f, v in fields.items()}
            route = self._routes.get(key)
            if route is not None and self._has_state(key):
                scheme = route.scheme
                scheme.check_loaded(key, _FieldBag(fields))
                current = self._read_state(key)
                if scheme.adaptive:  # the loaded state's fields follow its own choice
                    current = scheme.init_like(self.ops, self._infos[key], current[0], _FieldBag(fields))
                scheme.forget(key)  # the loaded state replaces what the scheme mirrors of it
                loaded = type(current)(**{f: fields.get(f) for f in current._fields}) \
                    if set(fields) == set(current._fields) else None
                if loaded is None:
                    raise ValueError(f"{scheme.name}: loaded state for tensor {key!r} has fields "
                                     f"{sorted(fields)}, expected {list(current._fields)}")
                self._check_loaded(scheme, key, loaded, current)
                self._write_state(key, type(current)(*[
                    self.ops.cast(self._to_device(v, c), self.ops.dtype(c)) for v, c in zip(loaded, current)]))
            else:
                self._pending[key] = _FieldBag(fields)

    # ---- reporting ----
    def wire_bytes(self) -> dict:
        """``{key: WireBytes}`` for every tensor seen: bytes per step, per rank, as routed
        (and widened for a TensorFlow group, see the module docstring)."""
        return dict(self._wire)

    def sparse_bytes(self) -> dict:
        """``{key: bytes}`` of each sparse gradient seen (indices and values this rank handed
        to Horovod's sparse path, as of the last step it was seen); they bypass compression."""
        return {key: self._read_sparse(entry)[0] for key, entry in self._sparse.items()}

    def bytes_per_step(self) -> StepBytes:
        """:meth:`wire_bytes` summed over tensors, plus the sparse gradients' own collectives
        (:class:`~hvd_gradcomp.base.StepBytes`; ``total`` counts everything)."""
        payload = side = collectives = 0
        for w in self._wire.values():
            payload, side, collectives = payload + w.payload, side + w.side, collectives + w.side_collectives
        return StepBytes(payload, side, collectives, sum(self.sparse_bytes().values()), 2 * len(self._sparse))

    def metrics(self) -> dict:
        """``{key: {name: value}}``: the schemes' per-tensor diagnostics (tensors, no host
        sync), and for sparse gradients ``sparse_bytes`` / ``sparse_steps`` (ints)."""
        out = {}
        for k in self._infos:
            if not (self._has_state(k) and k in self._routes):
                continue
            scheme = self._routes[k].scheme
            out[k] = dict(scheme.metrics(self._read_state(k)))
            if scheme.adaptive:  # auto: its choice, why, and the bytes it saves against fp16
                out[k].update(scheme.explain(k))
                info = self._infos[k]
                out[k]["bytes_saved"] = 2 * info.numel - self._wire[k].payload
        for key, entry in self._sparse.items():
            nbytes, steps = self._read_sparse(entry)
            out.setdefault(key, {}).update(sparse_bytes=nbytes, sparse_steps=steps)
        return out

    def decisions(self) -> list:
        """Every ``auto`` decision this compressor's tensors took, oldest first (dicts of
        :meth:`hvd_gradcomp.auto.AutoScheme.history_records`); [] without ``auto``."""
        seen, out = set(), []
        for route in self._routes.values():
            scheme = route.scheme
            if scheme.adaptive and id(scheme) not in seen:
                seen.add(id(scheme))
                out.extend(scheme.history_records())
        return out

    def _note_sparse(self, key, make_entry, label=None):
        """The entry of sparse gradient ``key``, created by ``make_entry()`` with a one-time
        warning naming it (``label``, else the key) if new."""
        entry = self._sparse.get(key)
        if entry is None:
            log.warning(_SPARSE_WARNING.format(name=label or key, spec=self.spec))
            entry = self._sparse[key] = make_entry()
        return entry

    def __repr__(self):
        from .registry import to_spec, with_min_numel
        text = (with_min_numel(to_spec(self.scheme, full=True), self.routing.min_numel)
                if self.routing.plain else self.spec)
        return f"{type(self).__name__}({text!r})"


class _FieldBag(tuple):
    """A loaded state whose NamedTuple type is not known until the tensor is first seen."""

    def __new__(cls, fields: dict):
        obj = super().__new__(cls, tuple(fields.values()))
        obj._fields = tuple(fields)
        return obj


class Factory:
    """``Compression.<name>``: call it with the scheme's options to get a new compressor.

    Each call returns a new object with its own per-tensor state; give each optimizer its
    own. Passing the factory itself (Horovod's ``compression=hvd.Compression.fp16`` habit)
    raises a TypeError that says so.
    """

    def __init__(self, compressor_cls, name):
        self._cls, self.name = compressor_cls, name
        self.__doc__ = f"A new {name} compressor; options: see {SCHEMES[name][0].__name__}."

    def __call__(self, *args, **options):
        """A new compressor; ``min_numel`` (tensors with fewer coordinates go as fp16; an
        integer >= 1, default :func:`~hvd_gradcomp.registry.small_default`) is a routing
        option accepted by every scheme (module :mod:`~hvd_gradcomp.routing`); the other
        options go to the scheme's config. Raises ValueError for an unknown or bad option."""
        min_numel = options.pop("min_numel", None)
        return self._cls(Routing.single(make_scheme(self.name, *args, **options), min_numel))

    def compress(self, tensor, *args, **kwargs):
        raise TypeError(f"Compression.{self.name} is a factory: pass Compression.{self.name}() "
                        f"(with options, if any) as compression=")

    decompress = compress

    def __repr__(self):
        return f"Compression.{self.name}"


class Namespace:
    """``Compression.<name>(**options)`` for every scheme, plus ``from_spec`` and ``names``."""

    def __init__(self, compressor_cls):
        self._cls = compressor_cls

    def __getattr__(self, name):
        if not name.startswith("_") and name.lower() in SCHEMES:
            name = name.lower()
        if name.startswith("_") or name not in SCHEMES:
            raise AttributeError(f"Compression has no compressor {name!r}; "
                                 f"expected one of {sorted(SCHEMES)}")
        return Factory(self._cls, name)

    def from_spec(self, spec: str):
        """A compressor from a text spec: a scheme (``"topkc:ratio=0.01,chunk=256"``) or rules
        (``"*.bias -> fp16; *embed* -> topkc:0.01; thc:min_numel=4096"``; grammar in
        :mod:`hvd_gradcomp.registry`). Raises ValueError for a malformed spec."""
        return self._cls(Routing.from_spec(spec))

    def rules(self, rules, default: str = "thc", min_numel=None):
        """A compressor that routes each tensor by name and size (:mod:`hvd_gradcomp.routing`).

        Args:
            rules: ``[(selector, scheme spec), ...]`` tried in order, e.g.
                ``[("*.bias", "fp16"), ("*embed*", "topkc:0.01"), ("numel>=1000000",
                "powersgd:4")]``; a selector is an fnmatch glob on the tensor's name and/or
                ``numel>=N`` / ``numel<N`` terms.
            default: scheme spec for tensors no rule names (default ``"thc"``).
            min_numel: tensors no rule names with fewer coordinates go as fp16; an integer
                >= 1; default 1024 for ``thc``/``topkc`` as default, else 1.

        In TensorFlow, rules with a glob need ``compressor.route(variables)`` before the first
        step (variable names may differ between ranks). Raises ValueError for a malformed
        rule, naming it.
        """
        return self._cls(Routing.from_rules(rules, default, min_numel))

    def names(self):
        """The compressor names offered (same in both frameworks)."""
        return sorted(SCHEMES)

    def __dir__(self):
        return sorted(SCHEMES) + ["from_spec", "names", "rules"]
