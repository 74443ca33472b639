"""Framework-neutral half of the Horovod compressor objects (``Compression.<name>(...)``).

Horovod calls ``compress(tensor) -> (payload, ctx)`` and ``decompress(payload, ctx)`` and
passes no name, step or op. This class keeps, per tensor key, the scheme's state and the
static facts (shape, dtype, bytes on the wire); the backend subclasses supply the primitives,
the tensor's identity (:meth:`_identify`), world size and rank, and state storage (plain
tensors in PyTorch, ``tf.Variable``s in TensorFlow).

Each instance belongs to one training run: give every ``DistributedOptimizer`` its own.
"""
from .registry import SCHEMES, make_scheme, parse_spec
from .base import Scheme, TensorInfo, WireBytes, check_state, compress_tensor, decompress_tensor, passes_through

__all__ = ["HorovodCompressor", "Namespace", "Factory"]


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
        "__weakref__",
    )
    ops = None  # the backend's Primitives (class attribute of the subclass)

    def __init__(self, scheme):
        self.scheme = scheme
        self._infos = {}
        self._wire = {}
        self._pending = {}

    # ---- backend hooks ----
    no_key_message = "{scheme}: cannot tell which tensor this is; call compress(tensor, name=...)"

    @staticmethod
    def _find_key(tensor):
        """The tensor's stable identity from Horovod's calling frames, or None."""
        raise NotImplementedError

    @staticmethod
    def _horovod():
        """The framework's Horovod module (horovod.torch or horovod.tensorflow)."""
        raise NotImplementedError

    def _identify(self, tensor) -> str:
        key = self._find_key(tensor)
        if key is None:
            raise ValueError(self.no_key_message.format(scheme=self.scheme.name))
        return key

    def _world(self):
        """(world_size, rank) of the all-reduce."""
        hvd = self._horovod()
        return hvd.size(), hvd.rank()

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

    # ---- Horovod's contract ----
    @property
    def spec(self) -> str:
        return self.scheme.spec()

    def compress(self, tensor, name=None):
        """Compress one gradient. Returns ``(payload, ctx)``; see the scheme's docs for layout.

        Args:
            tensor: the gradient (any shape; float tensors are compressed, others and empty
                tensors are returned untouched as their own payload).
            name: the tensor's stable identity; found from Horovod's call frames when None.

        Raises:
            ValueError: the tensor cannot be identified, or its shape/dtype differs from the
                state kept (or loaded) under its key. Raised before any collective.
        """
        ops = self.ops
        shape, dtype = ops.shape(tensor), ops.dtype(tensor)
        numel = 1
        for s in shape:
            numel *= s
        if passes_through(dtype, numel):
            return tensor, None
        key = name if name is not None else self._identify(tensor)
        world_size, rank = self._world()
        info = TensorInfo(key, shape, dtype, world_size, rank)
        known = self._infos.get(key)
        if known is not None and (known.shape, known.dtype) != (shape, dtype):
            raise ValueError(f"{self.scheme.name}: tensor {key!r} was {known.dtype}{list(known.shape)} "
                             f"in earlier steps, got {dtype}{list(shape)}; one key, one shape")
        self._infos[key] = info
        self._wire[key] = self.scheme.wire(info)
        if getattr(self.scheme, "identity", False):
            return tensor, None
        state = self._state_for(info, tensor)
        payload, ctx, new_state = compress_tensor(self.scheme, ops, tensor, state, info)
        if len(new_state):
            self._write_state(key, new_state)
        return payload, (info, ctx)

    def decompress(self, payload, ctx):
        """The all-reduced payload mapped back to the gradient's shape and dtype."""
        if ctx is None:
            return payload
        info, scheme_ctx = ctx
        out = decompress_tensor(self.scheme, self.ops, payload, scheme_ctx, info)
        if type(self.scheme).absorb is not Scheme.absorb and self._has_state(info.key):
            new_state = self.scheme.absorb(self.ops, payload, scheme_ctx, self._read_state(info.key), info)
            if new_state is not None:
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

    def load_state_dict(self, state_dict: dict):
        """Restore what :meth:`state_dict` returned (on the same rank, same model).

        Raises:
            ValueError: the spec differs from this compressor's, or a tensor's state has the
                wrong fields or shapes (checked now for tensors already seen, else at their
                first compress, before any collective).
        """
        if state_dict.get("spec") != self.spec:
            raise ValueError(f"state_dict was saved by compressor {state_dict.get('spec')!r}, "
                             f"this one is {self.spec!r}")
        for key, fields in state_dict["tensors"].items():
            info = self._infos.get(key)
            if info is not None and self._has_state(key):
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
        return f"{type(self).__name__}({self.spec!r})"


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

    def __call__(self, **options):
        return self._cls(make_scheme(self.name, **options))

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
