"""The DDP hook under ``torch.compile`` with compiled autograd and
``torch._dynamo.config.optimize_ddp = "python_reducer"`` (PyTorch 2.13).

There DDP keeps no buckets: a post-accumulate-grad hook of every parameter calls each
registered comm hook as ``hook(state, (param.grad, param))`` and ignores what it returns
(``DistributedDataParallel._register_accum_grad_hook``). :func:`arrive` (called by
:func:`torch_backend.ddp.hook` for that form, outside Dynamo's trace) gathers the gradients into
buckets in the order they become ready, per dtype and device, up to DDP's ``bucket_cap_mb``;
a full bucket is copied into one flat buffer and handed to the eager hook
(:func:`torch_backend.ddp.hook`: the same plans, schemes, error feedback, routing, checkpoints
and one collective per payload dtype), so the codec runs once per bucket. The first arrival
of a backward queues an autograd final callback, which sends the partial buckets left, waits
for every bucket's future and writes each parameter's mean into its ``.grad`` before
``backward()`` returns (as the FSDP overlap path, :mod:`torch_backend.fsdp_overlap`).

The ranks must see their gradients become ready in the same order (one compiled graph: they
do); a bucket's key is its parameters' identities, so a plan is made once per layout.
Refused at registration (:func:`check_model`): ``find_unused_parameters=True`` (a parameter
that one rank did not use would leave the ranks' buckets unequal) and ``Join`` (DDP's join
hook does not run under the Python reducer; nothing to check there).
"""
import torch

__all__ = ["check_model", "arrive", "ReadyBuckets"]


def check_model(ddp_model, spec):
    """ValueError where the compiled form cannot serve ``ddp_model`` (module docstring);
    nothing for a model that runs DDP's C++ reducer."""
    if not getattr(ddp_model, "_use_python_reducer", False):
        return
    if getattr(ddp_model, "find_unused_parameters", False):
        raise ValueError(f"register_comm_hook {spec!r}: a DDP model built under "
                         f"torch._dynamo.config.optimize_ddp='python_reducer' with "
                         f"find_unused_parameters=True is not supported (the hook gathers the "
                         f"gradients that arrive, and a parameter unused on one rank would leave "
                         f"the ranks' buckets unequal); use find_unused_parameters=False, or "
                         f"another optimize_ddp mode")


class _Bucket:
    """What the eager hook reads of a ``dist.GradBucket``: a flat buffer of its gradients."""

    def __init__(self, index, params, grads):
        self._index, self._params = index, params
        self._buffer = torch.cat([g.detach().reshape(-1) for g in grads])
        self._views, offset = [], 0
        for g in grads:
            self._views.append(self._buffer[offset:offset + g.numel()].view(g.shape))
            offset += g.numel()

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def gradients(self):
        return self._views

    def is_last(self):
        return False


class ReadyBuckets:
    """A hook state's buckets of one backward under the Python reducer (module docstring).

    Attributes:
        cap: a bucket's bytes (DDP's ``bucket_bytes_cap``; 25 MiB for a state made from a
            module).
        pending: {(dtype, device): [(grad, param), ...]} not sent yet.
        sent: [(bucket, future)] of this backward, in the order they were posted.
        task: the autograd graph task of the backward being gathered (None between them).
    """

    def __init__(self, cap):
        self.cap = cap
        self.pending, self.sent, self.task = {}, [], None

    def add(self, state, send, grad, param):
        """Take ``grad`` of ``param``; send its bucket when full; at the first gradient of a
        backward, queue the end of backward (what a backward that raised left is dropped)."""
        task = torch._C._current_graph_task_id()
        if task < 0:  # called outside a backward: this gradient is its own bucket
            self.pending, self.sent = {None: [(grad, param)]}, []
            return self.finish(state, send)
        if task != self.task:
            self.pending, self.sent, self.task = {}, [], task
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.finish(state, send))
        key = (grad.dtype, grad.device)
        group = self.pending.setdefault(key, [])
        group.append((grad, param))
        if sum(g.numel() * g.element_size() for g, _ in group) >= self.cap:
            self._send(state, send, self.pending.pop(key))

    def _send(self, state, send, group):
        bucket = _Bucket(len(self.sent), [p for _, p in group], [g for g, _ in group])
        self.sent.append((bucket, send(state, bucket)))

    def finish(self, state, send):
        """Send what is pending (in a rank-independent order), wait for every bucket and write
        each parameter's mean into its ``.grad``."""
        try:
            for key in sorted(self.pending, key=str):
                self._send(state, send, self.pending[key])
            with torch.no_grad():
                for bucket, fut in self.sent:
                    fut.wait()
                    for p, view in zip(bucket.parameters(), bucket.gradients()):
                        p.grad.copy_(view)
        finally:
            self.pending, self.sent, self.task = {}, [], None


@torch._dynamo.disable
def arrive(state, grad, param, send):
    """One parameter's ready gradient under the Python reducer, into ``state``'s
    :class:`ReadyBuckets` (made at the first call; a state of ``comm_state`` is bound then);
    ``send(state, bucket)`` is the eager hook. Returns None (DDP ignores it)."""
    if state.ready is None:
        model = state.ddp_model
        if model is not None:
            check_model(model, state.compressor.spec)
        if state.compressor.engine is None:
            state.bind(compiled=True)
        state.ready = ReadyBuckets(getattr(model, "bucket_bytes_cap", 25 * 1024 * 1024))
    state.ready.add(state, send, grad, param)
