"""Where a compressor keeps each tensor's scheme state: the :class:`Store` protocol.

A state is the scheme's NamedTuple of tensors (error feedback, TopKC's scores, THC's ranges,
PowerSGD's basis, counters), kept under the tensor's (or bucket group's) key. The compressor
reads and writes it through its ``store`` only; the framework decides how it lives: a dict
of tensors (:class:`DictStore`: PyTorch, and tests), ``tf.Variable`` s (TensorFlow, so a
traced ``tf.function`` reads and assigns them).

Protocol (every method required; keys are strings, equal on every rank):

- ``has(key) -> bool``; ``read(key) -> state``; ``write(key, state)`` (an existing key; a
  state whose fields or shapes changed, e.g. ``auto`` switching scheme, replaces it);
  ``create(key, state)`` (the first state of a key: TensorFlow makes its variables here);
  ``drop(key)`` (forget it: its error feedback moved into a bucket group).
- ``export(value, portable=False)``: a host copy of one state tensor for ``state_dict()``
  (``portable``: one that pickles without the framework, for ``gather=True``);
  ``load(value)``: a saved value (a tensor or NumPy array) as the framework's host tensor;
  ``zeros_like(value)``; ``to_device(value, like)``: ``value`` on ``like``'s device.
"""
from typing import Protocol

__all__ = ["Store", "DictStore"]


class Store(Protocol):
    """A compressor's per-key scheme state (module docstring)."""

    def has(self, key: str) -> bool: ...

    def read(self, key: str): ...

    def write(self, key: str, state) -> None: ...

    def create(self, key: str, state) -> None: ...

    def drop(self, key: str) -> None: ...

    def export(self, value, portable: bool = False): ...

    def load(self, value): ...

    def zeros_like(self, value): ...

    def to_device(self, value, like): ...


class DictStore:
    """States in a dict, tensors kept as given (no copies): the framework-free store.

    ``export`` returns the value itself and ``load``/``to_device`` their argument: a backend
    whose tensors need a host copy or a device move overrides those (PyTorch's
    ``torch_backend.compression.TorchStore``). ``zeros_like`` uses the primitives table.
    """

    __slots__ = ("states", "ops")

    def __init__(self, ops):
        self.states, self.ops = {}, ops

    def has(self, key):
        return key in self.states

    def read(self, key):
        return self.states[key]

    def write(self, key, state):
        self.states[key] = state

    def create(self, key, state):
        self.states[key] = state

    def drop(self, key):
        del self.states[key]

    def export(self, value, portable=False):
        return value

    def load(self, value):
        return value

    def zeros_like(self, value):
        ops = self.ops
        return ops.zeros(tuple(ops.shape(value)), ops.dtype(value), value)

    def to_device(self, value, like):
        return value

    def __repr__(self):
        return f"{type(self).__name__}({len(self.states)} states)"
