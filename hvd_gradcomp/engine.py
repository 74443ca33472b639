"""What a compressor needs of the engine that moves its payloads: the :class:`Engine` protocol.

An engine (DDP's process group, FSDP2's replicas, an in-process simulation) binds itself to a
compressor's codec with ``codec = compressor.codec.bind_engine(engine)``; the codec then takes
its world size and rank, its checkpoints' object gather and ``auto``'s link calibration from
the engine instead of Horovod. The engine's step, for each bucket::

    plan = codec.plan_bucket(members, dtype, "sum", group, buffer)     # cached per layout
    encoded = [codec.encode_unit(u, buffer[u.start:u.stop]) for u in plan.units]
    packed, works = post_payloads(ops, [p for p, _ in encoded], engine.post)
    reduced = unpack_payloads(ops, packed, [engine.wait(w) for w in works])
    outs = [codec.decode(p, ctx, divide=world_size) for (_, ctx), p in zip(encoded, reduced)]

(:mod:`hvd_gradcomp.payloads`: one collective per payload dtype). Protocol:

- ``world() -> (size, rank)`` of the engine's group;
- ``gather(obj) -> [obj of rank 0, 1, ...]`` on every rank (checkpoints, route checks);
- ``allreduce(x, average) -> tensor``: blocking, ``x`` unchanged (``calibrate()`` only);
- ``post(flat) -> work``: the elementwise sum of a flat payload buffer over the group,
  asynchronous (every rank posts the same buffers in the same order);
- ``wait(work) -> tensor``: the summed buffer of a posted work.

The codec itself calls ``world``, ``gather`` and ``allreduce`` only; ``post`` and ``wait``
are the engine's own payload path (the step above), so an engine that moves its payloads
otherwise (Horovod; ``torch_backend.simulated``, which reduces N virtual ranks' payloads in
one process) needs only the first three.

:class:`torch_backend.engine.ProcessGroupEngine` is the ``torch.distributed`` one.
"""
from typing import Any, Protocol

__all__ = ["Engine"]


class Engine(Protocol):
    """The collectives a compressor uses (module docstring)."""

    def world(self) -> tuple: ...

    def gather(self, obj) -> list: ...

    def allreduce(self, x, average: bool) -> Any: ...

    def post(self, flat) -> Any: ...

    def wait(self, work) -> Any: ...
