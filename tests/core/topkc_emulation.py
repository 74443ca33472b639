"""(Helper, not a test.) TopKC's ranks of one tensor simulated in one process (each rank
compresses with its own state; the all-reduce is the sum of the payloads in the payload's dtype,
then 1/n under Average), for tests/core/test_topkc.py and test_topkc_max_age.py.
"""
import dataclasses

import numpy as np

from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.registry import make_scheme
from tests.backends import as_float64, backend_tensor, one_rank_ops

__all__ = ["Ranks"]

_tensor, _np = backend_tensor, as_float64  # the shared helpers of tests/backends.py


class Ranks:
    """``n`` ranks of one tensor in one process; :meth:`step` is one training step of all."""

    def __init__(self, backend, n, shape, op="average", ops=None, **options):
        self.ops = ops or one_rank_ops(backend)
        self.backend, self.n, self.op = backend, n, op
        self.scheme = make_scheme("topkc", **options)
        self.infos = [TensorInfo("layer.w", tuple(shape), "float32", n, r, op) for r in range(n)]
        like = _tensor(backend, np.zeros(shape))
        self.states = [self.scheme.init(self.ops, info, like) for info in self.infos]
        self.payloads = self.ctxs = None

    def _compress_all(self, ops, xs):
        return [compress_tensor(self.scheme, ops, x, self.states[r], self.infos[r]) for r, x in enumerate(xs)]

    def step(self, grads):
        xs = [_tensor(self.backend, g) for g in grads]
        if self.scheme.blocking:
            # The side all-reduce inside compress: record every rank's contribution, then
            # compress again (compress changes nothing) with their sum as its result.
            seen = []
            self._compress_all(dataclasses.replace(self.ops, allreduce=lambda x, *a, **k: seen.append(x) or x), xs)
            total = seen[0]
            for x in seen[1:]:
                total = total + x
            sent = self._compress_all(dataclasses.replace(self.ops, allreduce=lambda x, *a, **k: total), xs)
        else:
            sent = self._compress_all(self.ops, xs)
        self.payloads = [p for p, _ in sent]
        self.ctxs = [c for _, c in sent]
        reduced = self.payloads[0]
        for p in self.payloads[1:]:
            reduced = reduced + p
        if self.op == "average":
            reduced = reduced * (1.0 / self.n)
        self.reduced = reduced
        outs = []
        for r in range(self.n):
            out, self.states[r] = finish_tensor(self.scheme, self.ops, reduced, self.ctxs[r],
                                                self.states[r], self.infos[r])
            outs.append(_np(out))
        return outs
