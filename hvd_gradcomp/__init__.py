"""hvd-gradcomp: gradient compressors for Horovod that pay off end to end.

This package is the framework-neutral core: the schemes (``cast``, ``topk``, ``topkc``, ...),
written once against :class:`~hvd_gradcomp.primitives.Primitives`, the counter-based RNG, the
scheme catalogue and text specs. It imports no framework and no NumPy; the frontends are
``torch_backend`` and ``tf_backend``.
"""
from .base import EmptyState, Scheme, TensorInfo, WireBytes
from .primitives import Primitives
from .registry import SCHEMES, make_scheme, parse_spec, to_spec

__all__ = ["EmptyState", "Scheme", "TensorInfo", "WireBytes", "Primitives", "SCHEMES",
           "make_scheme", "parse_spec", "to_spec"]
__version__ = "0.1.0"
