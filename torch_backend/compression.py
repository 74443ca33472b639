"""Horovod (PyTorch) compressors built from the shared schemes.

Usage, exactly like Horovod's own ``hvd.Compression.fp16``::

    import horovod.torch as hvd
    from torch_backend import Compression
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=Compression.topkc(ratio=0.01))

Tensor identity: Horovod passes ``compress`` only the gradient. The parameter it belongs to
is found in Horovod's calling frame (``DistributedOptimizer._allreduce_grad_async(p)`` and
its grouped variant hold ``p`` with ``p.grad is tensor``), and its key is Horovod's own name
for it (``named_parameters``, or ``allreduce.noname.<i>``), identical on every rank and
stable across steps whatever ``zero_grad`` does. ``hvd.allreduce(t, name=..., compression=c)``
uses ``name``. Anything else must call ``compress(tensor, name=...)``.
"""
import sys

import torch

from hvd_gradcomp.adapter import HorovodCompressor, Namespace

from .ops import OPS

__all__ = ["Compressor", "Compression"]

_NO_KEY = ("{scheme}: cannot tell which parameter this gradient belongs to; use the compressor "
           "through hvd.DistributedOptimizer, pass name= to hvd.allreduce, or call "
           "compress(tensor, name=...)")


def _horovod_name(tensor):
    """Horovod's name for the parameter whose .grad is ``tensor``, from the calling frames."""
    frame = sys._getframe(3)
    param = None
    for _ in range(8):
        if frame is None:
            break
        loc = frame.f_locals
        p = loc.get("p")
        if param is None and isinstance(p, torch.Tensor) and (p.grad is tensor or (
                p.grad is not None and p.grad.is_sparse)):
            param = p
        owner = loc.get("self")
        names = getattr(owner, "_parameter_names", None)
        if param is not None and isinstance(names, dict) and param in names:
            return names[param]
        name = loc.get("name")
        # hvd.allreduce(tensor, name=..., compression=c); not grouped_allreduce, whose one
        # name covers every tensor of the group.
        if param is None and isinstance(name, str) and frame.f_code.co_name == "allreduce":
            return name
        frame = frame.f_back
    return None


class Compressor(HorovodCompressor):
    """A Horovod compressor for PyTorch tensors (see :class:`hvd_gradcomp.adapter.HorovodCompressor`).

    State (residuals, counters) is kept as tensors on the gradient's device, one set per
    parameter. ``state_dict()`` returns CPU copies; ``load_state_dict`` moves them back.
    """

    __slots__ = ("_states",)
    ops = OPS

    def __init__(self, scheme):
        super().__init__(scheme)
        self._states = {}

    no_key_message = _NO_KEY
    _find_key = staticmethod(_horovod_name)

    @staticmethod
    def _horovod():
        import horovod.torch as hvd
        return hvd

    def _has_state(self, key):
        return key in self._states

    def _read_state(self, key):
        return self._states[key]

    def _write_state(self, key, state):
        self._states[key] = state

    def _export(self, tensor):
        return tensor.detach().cpu().clone()

    def _to_device(self, value, like):
        return torch.as_tensor(value).to(like.device)


Compression = Namespace(Compressor)
