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
"""
import dataclasses
from typing import Any, NamedTuple

from .registry import SCHEMES, make_scheme, parse_spec
from .base import EmptyState, Scheme, TensorInfo, WireBytes, check_state, compress_tensor, finish_tensor, passes_through
from .primitives import FLOAT_DTYPES

__all__ = ["HorovodCompressor", "Namespace", "Factory", "Call", "op_name"]


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
    """

    key: Any = None
    op: Any = None
    prescale: float = 1.0
    postscale: float = 1.0
    process_set: Any = None
    owner: Any = None
    filled_in: bool = False
    shape: Any = None


class HorovodCompressor:
    """Base of ``torch_backend.Compressor`` and ``tf_backend.Compressor``.

    Public methods (both frameworks):
        compress(tensor, name=None) / decompress(payload, ctx): Horovod's contract.
        state_dict() / load_state_dict(d): per-rank state for checkpoints.
        wire_bytes() -> {key: WireBytes}; bytes_per_step() -> WireBytes summed over tensors.
        metrics() -> {key: {name: tensor}} diagnostics (e.g. THC's saturated count).
        spec: the text spec of the scheme.
    """

    __slots__ = (
        # configuration
        "scheme",
        # per-tensor bookkeeping, keyed by the tensor's stable identity
        "_infos", "_wire",
        # states loaded by load_state_dict() before the tensor was first seen
        "_pending",
        # per key, the owners seen (optimizers, variables), in order of first use
        "_owners",
        # loss scale source (GradScaler / LossScaleOptimizer), see set_loss_scale()
        "_scale_source",
        "__weakref__",
    )
    ops = None  # the backend's Primitives (class attribute of the subclass)

    def __init__(self, scheme):
        self.scheme = scheme.bind(self.ops)
        self._infos = {}
        self._wire = {}
        self._pending = {}
        self._owners = {}
        self._scale_source = None

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

    def _read_state(self, key):
        raise NotImplementedError

    def _write_state(self, key, state):
        raise NotImplementedError

    def _create_state(self, key, state):
        """Store a tensor's first state (TensorFlow makes variables here); default: write it."""
        self._write_state(key, state)

    def _has_state(self, key) -> bool:
        raise NotImplementedError

    def _export(self, tensor):
        """A host-side copy of a state tensor for state_dict()."""
        raise NotImplementedError

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
        return self.scheme.spec()

    def _key(self, call: Call):
        """The state key of a call: Horovod's name, kept apart per optimizer/tape."""
        key = call.key
        if key is None:
            if type(self.scheme).init is Scheme.init:  # stateless: any key will do
                return "<unnamed>"
            raise ValueError(self.no_key_message.format(scheme=self.scheme.name))
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

    def _check_call(self, key, call: Call, info: TensorInfo):
        """Refuse, before any collective, what Horovod would do to a payload this scheme cannot take."""
        s = self.scheme
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
            tensor: the gradient (any shape; float tensors are compressed, others and empty
                tensors are returned untouched as their own payload).
            name: the tensor's stable identity; found from Horovod's call frames when None.

        Raises:
            ValueError: the tensor cannot be identified (stateful schemes), its shape/dtype
                differs from the state kept (or loaded) under its key, or Horovod would apply
                an op or scaling this scheme's payload cannot take. Raised before any
                collective, on every rank alike.
        """
        ops = self.ops
        dtype = ops.dtype(tensor)
        if dtype not in FLOAT_DTYPES:
            return tensor, None
        call = self._find_call(tensor)
        if name is not None:
            call = call._replace(key=name)
        tensor = self._static(tensor, call)
        shape = ops.shape(tensor)
        numel = 1
        for s in shape:
            numel *= s
        if passes_through(dtype, numel):
            return tensor, None
        key = self._key(call)
        world_size, rank = self._world(call.process_set)
        op = call.op if call.op in ("sum", "average") else None
        info = TensorInfo(key, shape, dtype, world_size, rank, op, call.process_set)
        self._check_call(key, call, info)
        known = self._infos.get(key)
        if known is not None and (known.shape, known.dtype) != (shape, dtype):
            raise ValueError(f"{self.scheme.name}: tensor {key!r} was {known.dtype}{list(known.shape)} "
                             f"in earlier steps, got {dtype}{list(shape)}; one key, one shape")
        self._infos[key] = info
        self._wire[key] = self.scheme.wire(info)
        if self.scheme.identity:
            return tensor, None
        tensor = self._detach(tensor)
        scale = None
        if self._scale_source is not None:
            scale = self._scale_of(self._scale_source)
            tensor = ops.cast(tensor, "float32") * (1.0 / scale)
            info_x = info if info.dtype == "float32" else dataclasses.replace(info, dtype="float32")
        else:
            info_x = info
        state = self._state_for(info, tensor)
        payload, ctx = compress_tensor(self.scheme, ops, tensor, state, info_x)
        return payload, (info, ctx, scale)

    def decompress(self, payload, ctx):
        """The all-reduced payload mapped back to the gradient's shape and dtype; the tensor's
        state moves on (or stays, if the payload says some rank failed this step)."""
        if ctx is None:
            return payload
        info, scheme_ctx, scale = ctx
        has_state = self._has_state(info.key)
        state = self._read_state(info.key) if has_state else EmptyState()
        if scale is None:
            out, new_state = finish_tensor(self.scheme, self.ops, payload, scheme_ctx, state, info)
        else:
            info_x = info if info.dtype == "float32" else dataclasses.replace(info, dtype="float32")
            out, new_state = finish_tensor(self.scheme, self.ops, payload, scheme_ctx, state, info_x)
            out = out * scale
            if info.dtype != "float32":
                out = self.ops.cast(out, info.dtype)
        if has_state and new_state is not state:
            self._write_state(info.key, new_state)
        return out

    def _state_for(self, info, like):
        """The state under info.key: existing, loaded, or freshly initialised; checked."""
        if self._has_state(info.key):
            return self._read_state(info.key)
        fresh = self._initial_state(info, like, self._pending.pop(info.key, None))
        if len(fresh):
            self._create_state(info.key, fresh)
            return self._read_state(info.key)
        return fresh

    def _to_device(self, value, like):
        return value

    def _initial_state(self, info, like, loaded):
        """The scheme's initial state for a tensor, or ``loaded`` checked against it.

        TensorFlow overrides this to build it outside any graph (it becomes tf.Variables).
        """
        fresh = self.scheme.init(self.ops, info, like)
        if loaded is None:
            return fresh
        self._check_loaded(info.key, loaded, fresh)
        return type(fresh)(*[self.ops.cast(self._to_device(v, like), self.ops.dtype(f))
                             for v, f in zip(loaded, fresh)])

    def _check_loaded(self, key, loaded, fresh):
        self.scheme.check_loaded(key, loaded)
        check_state(loaded, fresh, key)
        for field, a, b in zip(fresh._fields, loaded, fresh):
            if tuple(self.ops.shape(a)) != tuple(self.ops.shape(b)):
                raise ValueError(f"{self.scheme.name}: loaded state for tensor {key!r} has "
                                 f"{field} of shape {list(self.ops.shape(a))}, expected "
                                 f"{list(self.ops.shape(b))}")

    # ---- checkpoints ----
    def state_dict(self) -> dict:
        """Per-rank state: ``{"spec": str, "tensors": {key: {field: tensor}}}`` (host copies)."""
        tensors = {}
        for key in self._infos:
            if self._has_state(key):
                state = self._read_state(key)
                tensors[key] = {f: self._export(v) for f, v in zip(state._fields, state)}
        for key, state in self._pending.items():
            tensors.setdefault(key, {f: v for f, v in zip(state._fields, state)})
        return {"spec": self.spec, "tensors": tensors}

    def _same_config(self, spec) -> bool:
        """True if the text ``spec`` describes this compressor's scheme and config."""
        try:
            name, options = parse_spec(spec)
            return name == self.scheme.name and make_scheme(name, **options).config == self.scheme.config
        except (ValueError, TypeError, AttributeError):
            return False

    def load_state_dict(self, state_dict: dict):
        """Restore what :meth:`state_dict` returned (on the same rank, same model).

        Raises:
            ValueError: the spec differs from this compressor's, or a tensor's state has the
                wrong fields or shapes (checked now for tensors already seen, else at their
                first compress, before any collective).
        """
        if not self._same_config(state_dict.get("spec")):
            raise ValueError(f"state_dict was saved by compressor {state_dict.get('spec')!r}, "
                             f"this one is {self.spec!r}")
        for key, fields in state_dict["tensors"].items():
            info = self._infos.get(key)
            if info is not None and self._has_state(key):
                self.scheme.check_loaded(key, _FieldBag(fields))
                current = self._read_state(key)
                loaded = type(current)(**{f: fields.get(f) for f in current._fields}) \
                    if set(fields) == set(current._fields) else None
                if loaded is None:
                    raise ValueError(f"{self.scheme.name}: loaded state for tensor {key!r} has fields "
                                     f"{sorted(fields)}, expected {list(current._fields)}")
                self._check_loaded(key, loaded, current)
                self._write_state(key, type(current)(*[
                    self.ops.cast(self._to_device(v, c), self.ops.dtype(c)) for v, c in zip(loaded, current)]))
            else:
                self._pending[key] = _FieldBag(fields)

    # ---- reporting ----
    def wire_bytes(self) -> dict:
        """``{key: WireBytes}`` for every tensor seen: bytes per step, per rank."""
        return dict(self._wire)

    def bytes_per_step(self) -> WireBytes:
        """Sum of :meth:`wire_bytes` over all tensors (payload, side, side collectives)."""
        total = WireBytes(0, 0, 0)
        for w in self._wire.values():
            total = WireBytes(total.payload + w.payload, total.side + w.side,
                              total.side_collectives + w.side_collectives)
        return total

    def metrics(self) -> dict:
        """``{key: {name: tensor}}`` of the scheme's per-tensor diagnostics (no host sync)."""
        return {k: self.scheme.metrics(self._read_state(k)) for k in self._infos if self._has_state(k)}

    def __repr__(self):
        from .registry import to_spec
        return f"{type(self).__name__}({to_spec(self.scheme, full=True)!r})"


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
        return self._cls(make_scheme(self.name, *args, **options))

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
        """A compressor from a text spec such as ``"topkc:ratio=0.01,chunk=256"``."""
        name, options = parse_spec(spec)
        return self._cls(make_scheme(name, **options))

    def names(self):
        """The compressor names offered (same in both frameworks)."""
        return sorted(SCHEMES)

    def __dir__(self):
        return sorted(SCHEMES) + ["from_spec", "names"]
