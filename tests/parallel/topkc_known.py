"""(Helper, not a test.) The known gradients of the TopKC launches (tests/parallel/test_topkc.py,
test_topkc_tf.py): the parameters' shapes, the steps, the TopKC spec for tensors this small, and
each parameter's gradient and initial value, which every process can rebuild.
"""
import numpy as np

__all__ = ["SHAPES", "STEPS", "TOPKC", "grad_of", "init_of"]

SHAPES = {"a": (64,), "b": (64,), "w": (8, 16), "s": ()}
STEPS = 4

# These tensors are all below TopKC's default min_numel (1024), so the TopKC specs set it.
TOPKC = "topkc:ratio=0.25,chunk=8,min_numel=1"


def grad_of(name, rank, step, pas):
    """The gradient of parameter ``name`` on ``rank`` at ``step``, backward pass ``pas`` (float32)."""
    if name == "w" and step % 2 == 1:
        return None  # w takes no part in the loss on odd steps
    seed = [sorted(SHAPES).index(name), rank, step, pas]
    return np.random.default_rng(seed).standard_normal(SHAPES[name]).astype(np.float32)


def init_of(name):
    """The initial value of parameter ``name`` (float32), the same on every rank."""
    return np.random.default_rng([99, sorted(SHAPES).index(name)]).standard_normal(SHAPES[name]).astype(np.float32)
