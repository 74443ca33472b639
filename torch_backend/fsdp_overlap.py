"""``install(..., overlap=True)`` (:mod:`torch_backend.fsdp`, "Overlap"): each FSDP parameter
group's all-reduce across replicas posted in its hook and finished at the end of backward, so
that it travels while backward goes on.

FSDP2 (PyTorch 2.13) divides and casts the hook's output, then views it as the parameters'
sharded gradients, as soon as the hook returns (``foreach_reduce`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``). With overlap the hook hands FSDP
zeros instead (so each ``.grad`` is set to, or accumulates, zero), and an autograd final
callback, queued by each hook in its backward, waits for that group's all-reduces, decodes, applies
FSDP's own divide and cast (its private ``_get_gradient_divide_factors``, ``_div_if_needed``,
``_to_dtype_if_needed``) and adds the result into each ``.grad``: the values FSDP would have
written, bit for bit (``0 + t = t``), before ``backward()`` returns.
"""
import math

import torch
import torch.distributed as dist

__all__ = ["Overlap"]


def _fsdp_post_reduce():
    """FSDP2's divide factors, divide and cast of a reduced shard (private, PyTorch 2.13).

    Raises:
        RuntimeError: a PyTorch without them.
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            _div_if_needed, _get_gradient_divide_factors, _to_dtype_if_needed)
    except ImportError as e:
        raise RuntimeError(f"install(overlap=True): this PyTorch ({torch.__version__}) has no FSDP2 "
                           f"_get_gradient_divide_factors/_div_if_needed/_to_dtype_if_needed "
                           f"(written against 2.13); use overlap=False: {e}") from None
    return _get_gradient_divide_factors, _div_if_needed, _to_dtype_if_needed


class Overlap:
    """The end-of-backward half of ``overlap=True``: each group's finish queued as an autograd
    final callback of the backward that posted its all-reduce (FSDP's own, queued at the root's
    pre-backward, runs before them). Nothing outlives a backward: one that raises drops its
    callbacks with it."""

    def __init__(self):
        self.finished = 0  # group all-reduces finished at the end of a backward, so far
        self.factors, self.divide, self.cast = _fsdp_post_reduce()
        self.inflight = None  # the last all-reduce posted

    def post(self, flat, group):
        """``flat`` all-reduced (summed) on ``group``, asynchronously: its work. The one posted
        before it is waited for first, so that one at most is in flight (Gloo aborted the
        process now and then with two running at once); by then it has usually arrived, as
        the backward of a module lies between two modules' posts."""
        if self.inflight is not None:
            self.inflight.wait()
        self.inflight = dist.all_reduce(flat, group=group, async_op=True)
        return self.inflight

    def defer(self, finish) -> bool:
        """``finish()`` (one group's wait, decode and write) at the end of this backward; False
        where autograd takes no callback (the hook called outside a backward): the caller then
        finishes in place."""
        def run():
            finish()
            self.finished += 1
        try:
            torch.autograd.Variable._execution_engine.queue_callback(run)
        except RuntimeError:
            return False
        return True

    def write(self, fsdp_group, summed, params=None):
        """Add ``summed`` (the group's decoded flat shard, in the reduce dtype, as the hook
        would have left it) into its parameters' ``.grad``, after FSDP's divide and cast.
        ``params``: the FSDP parameters the flat holds, in its order (those FSDP reduced in
        this call: the ones with a gradient); None: all of the group's."""
        post = self.factors(fsdp_group._reduce_scatter_process_group, None, summed.dtype,
                            summed.device.type, fsdp_group.gradient_divide_factor,
                            fsdp_group.force_sum_reduction_for_comms)[1]
        self.divide(summed, post)
        flat = self.cast(summed, fsdp_group._orig_dtype)
        offset = 0
        for fp in fsdp_group.fsdp_params if params is None else params:
            view = torch.as_strided(flat, size=fp.sharded_size, stride=fp.contiguous_sharded_stride,
                                    storage_offset=offset)
            local = fp.sharded_param.grad._local_tensor
            local += view.to(local.device)
            offset += math.prod(fp.padded_sharded_param_size)
