"""TensorFlow frontend of hvd-gradcomp: ``from tf_backend import Compression``.

``Compression.<name>(**options)`` returns a compressor for ``hvd.DistributedGradientTape`` and
``hvd.DistributedOptimizer`` (Keras 2); ``Compression.from_spec("topkc:ratio=0.01")`` builds
one from text. ``OPS`` is the TensorFlow implementation of the shared primitives.
"""
from .compression import Compression, Compressor
from .ops import OPS

__all__ = ["Compression", "Compressor", "OPS"]
