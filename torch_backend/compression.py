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

Routing rules (``Compression.rules``) match the same names: Horovod's own collective names,
equal on every rank. Sparse gradients (``nn.Embedding(sparse=True)`` without
``sparse_as_dense``) go through Horovod's sparse path, never through ``compress``; ``decompress``
sees their gathered result and counts this rank's bytes (``bytes_per_step().sparse``).
"""
import sys

import torch

from hvd_gradcomp.adapter import Call, HorovodCompressor
from hvd_gradcomp.frontend import Frontend
from hvd_gradcomp.horovod_ops import op_name
from hvd_gradcomp.namespace import Namespace
from hvd_gradcomp.store import DictStore

from .ops import OPS

__all__ = ["Compressor", "Compression", "check_compressor", "TorchFrontend", "TorchStore"]

_NO_KEY = ("{scheme}: cannot tell which parameter this gradient belongs to; use the compressor "
           "through hvd.DistributedOptimizer, pass name= to hvd.allreduce, or call "
           "compress(tensor, name=...)")


def _adasum_code():
    """The code of Horovod's ``_DistributedAdasumOptimizer._allreduce_grad_async``, which calls
    ``compress(p)`` on the parameter's delta (None if this Horovod has no such method)."""
    from horovod.torch import optimizer
    method = getattr(getattr(optimizer, "_DistributedAdasumOptimizer", None), "_allreduce_grad_async", None)
    return getattr(method, "__code__", None)


def _find_call(tensor) -> Call:
    """Horovod's name, op, scaling and process set for ``tensor``, from the calling frames.

    ``hvd.DistributedOptimizer`` (``_allreduce_grad_async(p)`` and its grouped variant) holds
    the parameter ``p`` with ``p.grad is tensor``; its name is ``_parameter_names[p]``. Called
    from ``synchronize()``'s loop over parameters that got no gradient on this rank, the call
    is a fill-in. ``hvd.allreduce(t, name=..., compression=c, op=..., process_set=...)`` gives
    its arguments.
    """
    import horovod.torch as hvd
    frame = sys._getframe(1).f_back  # None where C++ called our caller (no Python frame above)
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
        if param is None and p is tensor and frame.f_code is _adasum_code():
            # hvd.DistributedOptimizer(op=hvd.Adasum) compresses the parameter's delta itself;
            # its class is named after the wrapped optimizer's ("SGD"), so the frame's code
            # tells it apart.
            return Call(getattr(owner, "_parameter_names", {}).get(p), "adasum", owner=owner)
        names = getattr(owner, "_parameter_names", None)
        if param is not None and isinstance(names, dict) and param in names:
            # the grouped call's frame (its list comprehension, where p is, has a frame of its
            # own before Python 3.12)
            gframe = next((f for f in (frame, frame.f_back) if f is not None
                           and f.f_code.co_name.startswith("_grouped")), None)
            grouped = gframe is not None
            op = op_name(hvd, getattr(owner, "op", None))
            factor = 1.0 if grouped else float(getattr(owner, "gradient_predivide_factor", 1.0))
            pre, post = (1.0 / factor, factor) if op == "average" and factor != 1.0 else (1.0, 1.0)
            caller = frame.f_back
            filled_in = caller is not None and caller.f_code.co_name == "synchronize" and \
                param in caller.f_locals.get("missing_p", ())
            bucket = None
            if grouped and isinstance(gframe.f_locals.get("ps"), (list, tuple)):  # groups=: a bucket
                bucket = tuple((names.get(q), q.grad) for q in gframe.f_locals["ps"])
                if any(n is None or g is None for n, g in bucket):
                    bucket = None
            return Call(names[param], op, pre, post, getattr(owner, "process_set", None), owner,
                        filled_in, bucket=bucket)
        # hvd.allreduce(tensor, name=..., compression=c); not grouped_allreduce, whose one
        # name covers every tensor of the group.
        if param is None and frame.f_code.co_name == "allreduce" and "compression" in loc:
            name = loc.get("name")
            return Call(name if isinstance(name, str) else None,
                        op_name(hvd, loc.get("op"), loc.get("average")),
                        float(loc.get("prescale_factor", 1.0)), float(loc.get("postscale_factor", 1.0)),
                        loc.get("process_set"))
        frame = frame.f_back
    return Call()


class TorchStore(DictStore):
    """The scheme states of a PyTorch compressor: tensors on the gradient's device, in a dict
    (:class:`hvd_gradcomp.store.DictStore`); exported as CPU copies, loaded back to the
    gradient's device."""

    __slots__ = ()

    def export(self, value, portable=False):
        return value.detach().cpu().clone()

    def load(self, value):
        return torch.as_tensor(value)

    def zeros_like(self, value):
        return torch.zeros_like(value)

    def to_device(self, value, like):
        return torch.as_tensor(value).to(like.device)


class TorchFrontend(Frontend):
    """What a codec needs of PyTorch (:class:`hvd_gradcomp.frontend.Frontend`): Horovod's
    calling frames (:func:`_find_call`), ``horovod.torch``, sparse gradients, GradScaler's
    scale, autograd, ``torch.distributed``'s world."""

    no_key_message = _NO_KEY
    find_call = staticmethod(_find_call)

    def horovod(self):
        import horovod.torch as hvd
        return hvd

    def on_gpu(self, tensor):
        return tensor.device.type == "cuda"

    def process_world(self):
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return None, None

    def route_items(self, params):
        for name, p in params:
            yield name, tuple(p.shape), str(p.dtype).removeprefix("torch."), None

    def is_sparse(self, tensor):
        return isinstance(tensor, torch.Tensor) and tensor.is_sparse

    def uncompressed(self, payload, compressor):
        """A sparse result in decompress: Horovod's ``synchronize()`` hands over the gathered
        gradient of parameter ``p`` (its frame); this rank's part is still ``p.grad``."""
        if not (isinstance(payload, torch.Tensor) and payload.is_sparse):
            return
        frame = sys._getframe(1).f_back  # None where C++ called our caller (no Python frame above)
        for _ in range(4):
            if frame is None:
                return
            loc = frame.f_locals
            names = getattr(loc.get("self"), "_parameter_names", None)
            p = loc.get("p")
            if frame.f_code.co_name == "synchronize" and isinstance(names, dict) and p in names:
                grad = p.grad
                nbytes = 0
                if grad is not None and grad.is_sparse:
                    nbytes = (grad._values().numel() * grad._values().element_size()
                              + grad._indices().numel() * grad._indices().element_size())
                entry = compressor.codec.tensors.note_sparse(names[p], lambda: [0, 0], compressor.spec)
                entry[0], entry[1] = nbytes, entry[1] + 1
                return
            frame = frame.f_back

    def scale_of(self, source):
        scale = getattr(source, "_scale", source)  # GradScaler keeps it as a device tensor
        if scale is None:
            raise ValueError("set_loss_scale: the GradScaler has no scale yet; call it after the "
                             "first scaler.scale(loss)")
        return scale.reshape(()).float() if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))

    def detach(self, tensor):
        # A gradient has no history unless it was made with create_graph=True: no detach (one
        # dispatch a tensor and step fewer; docs/bench.md, "THC's per-call cost").
        return tensor.detach() if tensor.requires_grad else tensor


class Compressor(HorovodCompressor):
    """A Horovod compressor for PyTorch tensors (see :class:`hvd_gradcomp.adapter.HorovodCompressor`).

    State (residuals, counters) is kept as tensors on the gradient's device, one set per
    parameter (:class:`TorchStore`). ``state_dict()`` returns CPU copies; ``load_state_dict``
    moves them back.
    """

    __slots__ = ()

    def __init__(self, routing):
        super().__init__(routing, OPS, TorchStore(OPS), TorchFrontend())


Compression = Namespace(Compressor)


def check_compressor(compressor, caller: str, engine: str, unbound: bool = True) -> Compressor:
    """``compressor`` if an engine other than Horovod (``caller``: the function's name for
    messages; ``engine``: where it runs, e.g. ``"DDP"``) can use it, else an error saying what
    to pass instead.

    Raises:
        TypeError: not a PyTorch compressor (a factory such as ``Compression.fp16`` without the
            call is named so).
        ValueError: ``unbound`` and the compressor is bound to an engine already (its state is
            kept per tensor key: each model needs its own); a route to a blocking two-round
            variant (its side all-reduce is Horovod's).
    """
    if not isinstance(compressor, Compressor):
        what = repr(compressor)
        hint = f"; pass {what}() (with options, if any)" if what.startswith("Compression.") else ""
        raise TypeError(f"{caller}: expected a compressor from torch_backend.Compression, got {what}{hint}")
    if unbound and compressor.engine is not None:
        raise ValueError(f"{caller}: compressor {compressor.spec!r} is already bound to "
                         f"{compressor.engine!r}; each model needs its own (its state is kept per "
                         f"tensor key)")
    blocking = sorted({s.spec() for s in compressor.routing.schemes() if s.blocking})
    if blocking:
        raise ValueError(f"{caller}: {compressor.spec!r} routes tensors to {blocking}, blocking "
                         f"two-round variants whose side all-reduce is Horovod's; use the scheme's "
                         f"default single-collective variant on {engine}")
    return compressor
