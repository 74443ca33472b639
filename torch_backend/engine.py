"""The collectives a compressor needs outside compress, on a ``torch.distributed`` process group.

A compressor bound to an engine (:meth:`hvd_gradcomp.codec.Codec.bind_engine`)
takes its world size and rank, its checkpoints' object gather (``state_dict(gather=True)``),
the route check and ``auto``'s link calibration from the engine instead of Horovod. The DDP
hook (:mod:`torch_backend.ddp`), FSDP (:mod:`torch_backend.fsdp`) and update sync bind one.
"""
import torch.distributed as dist

__all__ = ["ProcessGroupEngine"]


class ProcessGroupEngine:
    """A ``torch.distributed`` process group (None: the default group) as a compressor's engine.

    The :class:`hvd_gradcomp.engine.Engine` protocol: world() -> (size, rank) in the group;
    gather(obj) -> [obj of rank 0, 1, ...] on every rank (``dist.all_gather_object``);
    allreduce(x, average) -> x summed (or averaged) over the group, blocking, ``x`` itself
    unchanged; post(flat) -> a ``torch.futures.Future`` of ``flat`` summed in place over the
    group (``dist.all_reduce(..., async_op=True)``); wait(future) -> the summed tensor (on
    CUDA, the current stream made to wait for the all-reduce).
    """

    def __init__(self, group=None):
        self.group = group

    def world(self):
        return dist.get_world_size(self.group), dist.get_rank(self.group)

    def gather(self, obj):
        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def allreduce(self, x, average: bool):
        y = x.clone()
        dist.all_reduce(y, group=self.group)
        return y / dist.get_world_size(self.group) if average else y

    def post(self, flat):
        return dist.all_reduce(flat, group=self.group, async_op=True).get_future()

    def wait(self, work):
        return work.wait()[0]

    def __repr__(self):
        return f"ProcessGroupEngine({self.group!r})"
