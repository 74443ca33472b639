"""(Helper, not a test.) W ranks of PowerSGD's alternating variant simulated in one process
(tests/core/test_powersgd.py, test_powersgd_ranks.py): each rank compresses with its own state,
the payloads are summed in float32 as Horovod does, and every rank finishes with the sum.
"""
import numpy as np

from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from tests.backends import backend_tensor, one_rank_ops

__all__ = ["simulate", "rank_grads"]

_tensor = backend_tensor  # the shared helper of tests/backends.py


def simulate(backend, scheme, grads, states=None, op="sum", key="w", contribute=None):
    """W ranks of the alternating variant in one process: grads[step][rank] (NumPy).

    Each rank compresses; the payloads are summed in float32 (divided by W for "average"),
    as Horovod does; every rank decompresses and finishes with that sum. ``states``: the
    ranks' initial states (fresh when None). ``contribute[step][rank] = False``: that rank
    sits the step out (``hvd.join()``): it adds zeros and its state stays. Returns one dict
    per step: outs (per rank, None when sitting out), before and after (states), payload.
    """
    ops = one_rank_ops(backend)
    world = len(grads[0])
    shape = np.shape(grads[0][0])
    infos = [TensorInfo(key, shape, "float32", world, r, op) for r in range(world)]
    if states is None:
        states = [scheme.init(ops, info, None) for info in infos]
    log = []
    for t, xs in enumerate(grads):
        live = [True] * world if contribute is None else contribute[t]
        sent = {}
        for r in range(world):
            if live[r]:
                sent[r] = compress_tensor(scheme, ops, _tensor(backend, xs[r]), states[r], infos[r])
        total = None
        for payload, _ in sent.values():
            total = payload if total is None else total + payload
        if op == "average":
            total = total * (1.0 / world)
        outs, after = [], []
        for r in range(world):
            if live[r]:
                out, new = finish_tensor(scheme, ops, total, sent[r][1], states[r], infos[r])
                outs.append(out)
                after.append(new)
            else:
                outs.append(None)
                after.append(states[r])
        log.append({"outs": outs, "before": states, "after": after, "payload": total})
        states = after
    return log


def rank_grads(seed, world, steps, shape):
    """grads[step][rank]: standard normal float64 arrays of ``shape``, seeded by ``seed``."""
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(shape) for _ in range(world)] for _ in range(steps)]
