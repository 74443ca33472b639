"""The contract between compression schemes (framework-neutral) and the backend adapters.

A *scheme* is the math of one compressor, written once against :class:`~.primitives.Primitives`:

- ``init(ops, info, like) -> State``: the per-tensor state (a ``NamedTuple`` of tensors, or
  :class:`EmptyState`), created on ``like``'s device.
- ``compress(ops, x, state, info, finite) -> (payload, ctx, new_state)``: ``x`` is the
  gradient as a float32 tensor of ``info.shape``; ``finite`` is a bool 0-d tensor, False when
  ``x`` holds a NaN/inf (None for schemes with ``guards_nonfinite = False``). ``payload`` is the one tensor Horovod all-reduces;
  ``ctx`` is whatever ``decompress`` needs (tensors or Python values); ``new_state`` replaces
  ``state``. Side collectives (``ops.allreduce``) happen here, before the payload exists.
- ``decompress(ops, payload, ctx, info) -> float32 tensor of info.shape``: the all-reduced
  payload mapped back. Under ``op=Sum`` it is the sum of the ranks' decoded contributions,
  under ``op=Average`` their mean (float payloads are linear in the contributions, so this
  holds without knowing the op; integer payloads carry their own op marker, see ``thc``).
- ``wire(info) -> WireBytes``: bytes this tensor puts on the wire per step; a function of
  (shape, dtype, config, world size) only, never of values.

The adapters (``torch_backend``, ``tf_backend``) own the state map, the tensor identity and
everything framework-specific; :func:`compress_tensor` and :func:`decompress_tensor` hold the
rules every scheme shares (dtype handling, pass-through, non-finite input).
"""
from dataclasses import dataclass
from typing import Any, NamedTuple

from .primitives import FLOAT_DTYPES

__all__ = ["EmptyState", "TensorInfo", "WireBytes", "Scheme", "compress_tensor",
           "decompress_tensor", "poison", "passes_through", "check_state"]


class EmptyState(NamedTuple):
    """State of a stateless scheme (no fields)."""


@dataclass(frozen=True)
class TensorInfo:
    """What a scheme may know about the tensor it compresses.

    Attributes:
        key: stable identity of the tensor across steps and ranks (Horovod's parameter name).
        shape: static shape of the gradient (tuple of ints).
        dtype: dtype string of the gradient (one of FLOAT_DTYPES).
        world_size: number of ranks in the all-reduce (>= 1).
        rank: this process's rank in [0, world_size).
    """

    key: str
    shape: tuple
    dtype: str
    world_size: int
    rank: int

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
    side: bytes of all side collectives issued inside compress.
    side_collectives: how many side collectives compress issues (each costs a latency).
    """

    payload: int
    side: int = 0
    side_collectives: int = 0

    @property
    def total(self) -> int:
        return self.payload + self.side


class Scheme:
    """Base class of the framework-neutral schemes (see the module docstring).

    Subclasses set ``name`` and ``config`` and implement ``compress``/``decompress``/``wire``;
    the default ``init`` returns :class:`EmptyState`.
    """

    name = "scheme"
    config: Any = None
    # Schemes that select or quantise must route a NaN/inf to every rank's output themselves
    # (see poison); plain casts propagate it through the all-reduce on their own.
    guards_nonfinite = True
    # Schemes whose state must stay identical across ranks (a step counter keying shared
    # randomness) hold it back themselves when *any* rank was non-finite, a condition they
    # learn from a side collective and that implies this rank's; compress_tensor then skips
    # its own, redundant per-rank masking pass over the state.
    masks_own_state = False

    def spec(self) -> str:
        """The text spec that rebuilds this scheme, e.g. ``"topkc:ratio=0.01,chunk=256"``."""
        from .registry import to_spec  # noqa: avoid an import cycle
        return to_spec(self)

    def init(self, ops, info: TensorInfo, like):
        return EmptyState()

    def compress(self, ops, x, state, info: TensorInfo, finite):
        raise NotImplementedError(f"{type(self).__name__}.compress")

    def decompress(self, ops, payload, ctx, info: TensorInfo):
        raise NotImplementedError(f"{type(self).__name__}.decompress")

    def wire(self, info: TensorInfo) -> WireBytes:
        raise NotImplementedError(f"{type(self).__name__}.wire")

    def absorb(self, ops, payload, ctx, state, info: TensorInfo):
        """State update that needs the all-reduced payload; None (the default) for none.

        Called by the adapters right after ``decompress`` with the same arguments plus the
        current state; returns the new state or None.
        """
        return None

    def metrics(self, state) -> dict:
        """Per-tensor diagnostics read from the state (tensors, no host sync); default none."""
        return {}

    def __repr__(self):
        return f"<{type(self).__name__} {self.spec()}>"


def passes_through(dtype: str, numel: int) -> bool:
    """True for tensors every compressor hands to Horovod untouched: non-float or empty."""
    return dtype not in FLOAT_DTYPES or numel == 0


def check_state(state, expected, key: str):
    """Raise ValueError unless ``state`` has the fields of ``expected`` (shapes: the adapter).

    Both are NamedTuples of tensors; ``expected`` is a freshly initialised state. Used when a
    state is loaded and on each compress, so a wrong checkpoint is refused on every rank before
    any collective is posted.
    """
    if tuple(state._fields) != tuple(expected._fields):
        raise ValueError(f"state for tensor {key!r}: expected fields {list(expected._fields)} "
                         f"({type(expected).__name__}), got {list(state._fields)}")


def poison(ops, payload, finite):
    """Make a float payload NaN everywhere when ``finite`` (bool 0-d tensor) is False.

    After the all-reduce every rank's output is then non-finite, so a loss scaler skips the
    step on all ranks together (a NaN on one rank alone would desynchronise them).
    """
    return payload + ops.cast(ops.where(finite, 0.0, float("nan")), ops.dtype(payload))


def compress_tensor(scheme: Scheme, ops, tensor, state, info: TensorInfo):
    """Shared compress rules around ``scheme.compress``.

    1. The gradient is viewed in float32 (fp16/bf16/fp64 inputs are cast; fp64 loses precision
       beyond float32, which every payload here has anyway).
    2. ``scheme.compress`` runs on it.
    3. If any input coordinate is NaN/inf (or the float32 sum of the gradient overflows), the
       state is kept as it was, so the non-finite values never enter the residual (schemes
       with ``masks_own_state`` do this themselves, on the all-ranks condition); the scheme
       makes the payload carry the non-finite marker (:func:`poison` for float payloads).

    Returns:
        (payload, ctx, new_state).
    """
    x = ops.cast(tensor, "float32") if info.dtype != "float32" else tensor
    # One reduction instead of an elementwise test plus an all(): the float32 sum is non-finite
    # iff some coordinate is NaN/inf, or the finite values sum beyond 3.4e38 (a gradient that
    # large is treated as non-finite too). 4M coordinates: 0.3 ms against 13 ms for all(isfinite).
    finite = ops.isfinite(ops.sum(x, None)) if scheme.guards_nonfinite else None
    payload, ctx, new_state = scheme.compress(ops, x, state, info, finite)
    if len(state) and not scheme.masks_own_state:
        new_state = type(new_state)(*[ops.where(finite, new, old)
                                       for new, old in zip(new_state, state)])
    return payload, ctx, new_state


def decompress_tensor(scheme: Scheme, ops, payload, ctx, info: TensorInfo):
    """``scheme.decompress`` followed by a cast back to the gradient's dtype and shape."""
    out = scheme.decompress(ops, payload, ctx, info)
    out = ops.reshape(out, info.shape)
    return ops.cast(out, info.dtype) if info.dtype != "float32" else out
