"""(Helper, not a test.) The probe model of the DDP launches (tests/parallel/test_ddp.py and the
other DDP, checkpoint and bucket tests): a module whose loss is ``sum(p * G_r[p])``, so each
rank's gradient of parameter ``p`` at step ``t`` is ``G_r[p]`` (:func:`grads_of`, seeded: every
process can rebuild it); one training step, each parameter's pending error feedback, a counter
of ``dist.all_reduce`` calls, and the check of resumed totals.
"""
import numpy as np

__all__ = ["SHAPES", "SPECS", "STEPS", "RESUME", "grads_of", "probe_cls", "probe_step", "residuals",
           "AllReduceCounter", "check_resumed_totals"]

SHAPES = {"w": (64, 64), "b": (64,), "v": (32, 64)}
SPECS = ["fp16", "topkc:0.1", "thc", "powersgd:2", "signsgd", "auto"]
STEPS = 4
RESUME = 2


def grads_of(rank, step, shapes=SHAPES, scale=1.0):
    """The seeded gradients of ``rank`` at ``step``: {name: float32 tensor}."""
    import torch
    g = torch.Generator().manual_seed(10007 * step + 101 * rank + 7)
    return {n: torch.randn(s, generator=g) * scale for n, s in shapes.items()}


def probe_cls():
    import torch

    class Probe(torch.nn.Module):
        """loss = sum_p sum(p * G[p]): the gradient of p is G[p]."""

        def __init__(self, shapes=SHAPES):
            super().__init__()
            for n, s in shapes.items():
                self.register_parameter(n, torch.nn.Parameter(torch.zeros(s)))

        def forward(self, grads):
            return sum((p * grads[n]).sum() for n, p in self.named_parameters())

    return Probe


def probe_step(ddp, grads, factor=1.0):
    for p in ddp.parameters():
        p.grad = None
    (ddp(grads) * factor).backward()
    return {n: p.grad.detach().double().numpy().copy() for n, p in ddp.module.named_parameters()}


def residuals(comp):
    """{key: this rank's pending error feedback, float64, or None} of every parameter seen
    (``error_feedback``: the parameter's own state, or its slice of a bucket group's)."""
    out = {}
    for key in comp.routes():
        r = comp.error_feedback(key)
        out[key] = None if r is None else r.double().numpy().copy()
    return out


class AllReduceCounter:
    """Wraps ``dist.all_reduce``: records (dtype, bytes) of each call."""

    def __init__(self):
        import torch.distributed as dist
        self.dist, self.inner, self.calls = dist, dist.all_reduce, []

    def __enter__(self):
        def counted(tensor, *args, **kwargs):
            self.calls.append((str(tensor.dtype), tensor.numel() * tensor.element_size()))
            return self.inner(tensor, *args, **kwargs)
        self.dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        self.dist.all_reduce = self.inner


def check_resumed_totals(recs, world):
    """Per tensor: world x (the outputs of the resumed steps) + every rank's pending error
    feedback is the same for the continued and the resumed compressor (up to fp16 rounding)."""
    for n in SHAPES:
        totals = []
        for run in (0, 1):
            delivered = world * sum(step[run][n] for step in recs[0]["resume"])
            owed = sum(rec["owed"][run].get(n) if rec["owed"][run].get(n) is not None else 0.0 for rec in recs)
            totals.append(delivered + (np.reshape(owed, delivered.shape) if np.ndim(owed) else owed))
        # fp16 payloads round each delivered step by up to 2^-11 of its size and keep no
        # residual for it: the bound is that rounding, far below a lost or doubled step.
        bound = 2.0 ** -10 * len(recs[0]["resume"]) * np.abs(totals[0]).max()
        np.testing.assert_allclose(totals[1], totals[0], rtol=0, atol=bound, err_msg=n)
