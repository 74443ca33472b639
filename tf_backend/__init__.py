"""TensorFlow frontend of hvd-gradcomp: ``from tf_backend import Compression``.

``Compression.<name>(**options)`` returns a compressor for ``hvd.DistributedGradientTape`` and
``hvd.DistributedOptimizer`` (Keras 2); ``Compression.from_spec("topkc:ratio=0.01")`` builds
one from text. ``OPS`` is the TensorFlow implementation of the shared primitives. ``FrozenVarianceAdamW``: AdamW whose second moment
freezes after a warm-up (docs/optimizers.md).
"""
from .compression import Compression, Compressor
from .ops import OPS
from .optim import FrozenVarianceAdamW

__all__ = ["Compression", "Compressor", "FrozenVarianceAdamW", "OPS"]
