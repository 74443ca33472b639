"""Test configuration.

HVD_GRADCOMP_BACKENDS (comma-separated, default "torch,tensorflow") names the backends under
test; an unknown name is an error.
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

KNOWN_BACKENDS = ("torch", "tensorflow")
BACKENDS = tuple(b.strip() for b in os.environ.get("HVD_GRADCOMP_BACKENDS", ",".join(KNOWN_BACKENDS)).split(",") if b.strip())
_unknown = [b for b in BACKENDS if b not in KNOWN_BACKENDS]
if _unknown:
    raise pytest.UsageError(f"HVD_GRADCOMP_BACKENDS names unknown backend(s) {_unknown}; known: {KNOWN_BACKENDS}")


def backend_ops(name):
    """The Primitives instance of a backend by name."""
    if name == "torch":
        from torch_backend import OPS
    else:
        from tf_backend import OPS
    return OPS


def backend_tensor(backend, values, dtype="float32"):
    """A tensor of ``backend`` ("torch"/"tensorflow") holding ``values`` (via float64) as ``dtype``."""
    import numpy as np
    if backend == "torch":
        import torch
        from torch_backend.ops import to_torch_dtype
        return torch.as_tensor(np.asarray(values, dtype=np.float64)).to(to_torch_dtype(dtype))
    import tensorflow as tf
    return tf.cast(tf.constant(np.asarray(values, dtype=np.float64)), dtype)


def as_float64(x):
    """A PyTorch or TensorFlow tensor as a float64 NumPy array (detached)."""
    import numpy as np
    if hasattr(x, "detach"):
        import torch
        return x.detach().to(torch.float64).numpy()
    import tensorflow as tf
    return np.asarray(tf.cast(x, tf.float64))


def requires_backend(name):
    return pytest.mark.skipif(name not in BACKENDS, reason=f"backend {name} not under test")


def one_rank_ops(name):
    """A backend's primitives with the side all-reduce of a one-rank world (the identity)."""
    from hvd_gradcomp.primitives import one_rank
    return one_rank(backend_ops(name))


def scheme_steps(ops, scheme, tensors, info):
    """Run compress -> (one-rank all-reduce) -> decompress + finish over ``tensors``.

    Returns one dict per step: payload, ctx, out (decompressed), old (state before) and after
    (state after finish, i.e. the next step's).
    """
    from hvd_gradcomp.base import compress_tensor, finish_tensor
    state = scheme.init(ops, info, tensors[0])
    log = []
    for x in tensors:
        payload, ctx = compress_tensor(scheme, ops, x, state, info)
        out, after = finish_tensor(scheme, ops, payload, ctx, state, info)
        log.append({"payload": payload, "ctx": ctx, "out": out, "old": state, "after": after})
        state = after
    return log
