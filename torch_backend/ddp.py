"""hvd-gradcomp's compressors as PyTorch DDP communication hooks.

Usage::

    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_backend import Compression
    from torch_backend.ddp import register_comm_hook
    ddp_model = DDP(model)
    comp = Compression.topkc(0.1)            # any spec, rules and auto included
    register_comm_hook(ddp_model, comp)      # calls ddp_model.register_comm_hook(state, hook)

The compressor object is the one Horovod users pass as ``compression=``; everything it offers
(``state_dict``/``load_state_dict``, ``bytes_per_step``, ``metrics``, ``routes``,
``set_loss_scale``, :class:`~torch_backend.stats.CompressionStats`) behaves as with Horovod,
with the DDP model's process group in place of Horovod's global set (ranks, world size,
``state_dict(gather=True)``'s object gather, ``calibrate()`` for ``auto``).

**Identity.** Each gradient of a bucket (``bucket.gradients()``) is keyed by its parameter's
name in the wrapped module (``ddp_model.module.named_parameters()``, the names Horovod users
pass as ``named_parameters``), equal on every rank and stable across DDP's bucket rebuild, so
routing rules match those names and each parameter keeps its own state.

**One collective per bucket.** Each gradient is compressed as Horovod's adapter does it
(routing, loss scale, error feedback, checks). The bucket's payloads are flattened and
concatenated, one tensor per payload dtype (sorted by name: e.g. THC's int32 words and the
float16 of its small tensors travel in two), each summed by one ``dist.all_reduce(...,
async_op=True)`` on the DDP process group; the future's ``then`` scatters the sums back,
decompresses each (the tensor's state moves on) and writes the result, divided by the process
group's size (DDP expects the average), into the bucket's gradients. The schemes are told
``op=Sum``: decoding the sum and dividing it is exact for every scheme (an Average would need
Horovod's scaling of integer words).

**Joined ranks** (``torch.distributed.algorithms.Join`` with uneven inputs): a rank that has
joined shadows each bucket's all-reduce with a zero gradient. Here it compresses that zero
gradient only to learn the payloads' shapes, sends zero payloads (contributing nothing, as a
rank in ``hvd.join()`` does: THC's and auto's count lanes see it) and keeps its rank-local
state (:attr:`~hvd_gradcomp.base.Scheme.rank_local_fields`: its error feedback) as it was,
while the fields the ranks agree on move on from the same all-reduced payload as everywhere
else. (When ``auto`` changes a tensor's scheme during those steps, the fields no longer fit,
and that rank's pending error feedback for the tensor is dropped, with a warning.) The result is divided by the process group's size, as
``Join(..., divide_by_initial_world_size=True)`` (the default) does; ``False`` is refused.

Refused with a ValueError, before any collective and on every rank: a compressor already
bound to a DDP model, a parameter DDP hands over that the model does not name, the papers'
blocking two-round variants (their side all-reduce is Horovod's), and everything the Horovod
adapter refuses (a shape change under one key, a checkpoint routed differently, ...).
"""
import logging
import sys

import torch
import torch.distributed as dist

from .compression import Compressor
from .engine import ProcessGroupEngine

__all__ = ["register_comm_hook", "make_comm_hook", "hook", "HookState", "DDPEngine"]

log = logging.getLogger("hvd_gradcomp")


DDPEngine = ProcessGroupEngine  # the name it had before torch_backend.engine


class HookState:
    """What :func:`hook` needs: the compressor, the parameters' names, the DDP model's process
    group and its size."""

    def __init__(self, compressor, names: dict, group, world_size: int, ddp_model):
        self.compressor = compressor
        self.names = names  # parameter tensor -> name (parameters hash by identity)
        self.group = group
        self.world_size = world_size
        self.ddp_model = ddp_model


def _joined() -> bool:
    """True when the hook runs on a rank that has joined (DDP's Join hook shadows the
    backward all-reduces from ``_match_all_reduce_for_bwd_pass``)."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code.co_name == "_match_all_reduce_for_bwd_pass":
            return True
        frame = frame.f_back
    return False


def hook(state: HookState, bucket):
    """DDP communication hook: compress every gradient of ``bucket``, all-reduce the payloads
    (one collective per payload dtype), decompress, average (module docstring).

    Returns a ``torch.futures.Future`` holding ``bucket.buffer()`` with the averaged,
    decompressed gradients written into it.

    Raises:
        ValueError: a gradient whose parameter the model does not name, ``Join`` with
            ``divide_by_initial_world_size=False``, or what the compressor refuses (on every
            rank, before the collective).
    """
    comp = state.compressor
    joined = _joined()
    if not getattr(state.ddp_model, "_divide_by_initial_world_size", True):
        raise ValueError(f"hvd_gradcomp DDP hook {comp.spec!r}: Join(..., "
                         f"divide_by_initial_world_size=False) is not supported (the hook divides "
                         f"by the process group's size); use the default True")
    grads = bucket.gradients()
    entries = []
    for p, g in zip(bucket.parameters(), grads):
        name = state.names.get(p)
        if name is None:
            raise ValueError(f"hvd_gradcomp DDP hook {comp.spec!r}: bucket {bucket.index()} holds a "
                             f"parameter of shape {list(p.shape)} that the DDP model's "
                             f"named_parameters() does not name; register the hook on the DDP "
                             f"model that owns it")
        payload, ctx = comp.encode(g, name, op="sum", group=state.group)
        entries.append((payload, ctx, g))
    by_dtype = {}
    for i, (payload, _, _) in enumerate(entries):
        by_dtype.setdefault(payload.dtype, []).append(i)
    order = sorted(by_dtype, key=str)
    futures, layouts = [], []
    for dtype in order:
        members = by_dtype[dtype]
        flat = torch.cat([entries[i][0].reshape(-1) for i in members])
        if joined:
            flat = torch.zeros_like(flat)
        layouts.append([(i, entries[i][0].shape, entries[i][0].numel()) for i in members])
        futures.append(dist.all_reduce(flat, group=state.group, async_op=True).get_future())
    n = state.world_size
    buffer = bucket.buffer()

    def unpack(fut):
        results = [f.value()[0] for f in fut.value()] if len(futures) > 1 else [fut.value()[0]]
        with torch.no_grad():
            for flat, layout in zip(results, layouts):
                offset = 0
                for i, shape, numel in layout:
                    payload = flat[offset:offset + numel].reshape(shape)
                    offset += numel
                    ctx, g = entries[i][1], entries[i][2]
                    if joined:
                        comp.decode_joined(payload, ctx)
                        continue
                    out = comp.decompress(payload, ctx)
                    g.copy_(out.reshape(g.shape).to(g.dtype) / n)
        return buffer

    if len(futures) == 1:
        return futures[0].then(unpack)
    return torch.futures.collect_all(futures).then(unpack)


def make_comm_hook(ddp_model, compressor):
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``, with ``compressor``
    bound to the model's process group: what :func:`register_comm_hook` registers, for callers
    that wrap the hook (e.g. to time it). Arguments and errors as there."""
    from torch.nn.parallel import DistributedDataParallel
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"register_comm_hook: expected a DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}")
    if not isinstance(compressor, Compressor):
        what = repr(compressor)
        hint = f"; pass {what}() (with options, if any)" if what.startswith("Compression.") else ""
        raise TypeError(f"register_comm_hook: expected a compressor from torch_backend.Compression, "
                        f"got {what}{hint}")
    if compressor.engine is not None:
        raise ValueError(f"register_comm_hook: compressor {compressor.spec!r} is already bound to a "
                         f"DDP model; each model needs its own (its state is kept per parameter name)")
    blocking = sorted({s.spec() for s in compressor.routing.schemes() if s.blocking})
    if blocking:
        raise ValueError(f"register_comm_hook: {compressor.spec!r} routes tensors to {blocking}, "
                         f"blocking two-round variants whose side all-reduce is Horovod's; use "
                         f"the scheme's default single-collective variant on DDP")
    group = ddp_model.process_group
    names = {p: name for name, p in ddp_model.module.named_parameters()}
    compressor.bind_engine(ProcessGroupEngine(group))
    world_size, _ = compressor.engine.world()
    if any(s.adaptive and s.link is None for s in compressor.routing.schemes()):
        like = next(iter(names), None)
        compressor.calibrate(like=None if like is None else like.detach())
    return HookState(compressor, names, group, world_size, ddp_model), hook


def register_comm_hook(ddp_model, compressor):
    """Install ``compressor`` as ``ddp_model``'s communication hook.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel``, before its first backward.
        compressor: a compressor from ``torch_backend.Compression`` (``Compression.topkc(0.1)``,
            ``from_spec``, ``rules``, ``auto``), new or loaded from a checkpoint, used by no
            other model.

    Binds the compressor to the model's process group (ranks, world size, checkpoints), and
    for ``auto`` without ``bandwidth_gbit`` measures the link there (``calibrate()``: a
    collective, so every rank calls ``register_comm_hook`` at the same point). Returns the
    compressor.

    Raises:
        TypeError: ``compressor`` is a factory (``Compression.fp16`` without the call) or not a
            PyTorch compressor; ``ddp_model`` is not a DDP model.
        ValueError: the compressor is already bound to a DDP model, or routes some tensor to a
            blocking two-round variant.
    """
    state, fn = make_comm_hook(ddp_model, compressor)
    ddp_model.register_comm_hook(state, fn)
    return compressor
