"""TensorFlow frontend of hvd-gradcomp: ``from tf_backend import Compression``.

``Compression.<name>(**options)`` returns a compressor for ``hvd.DistributedGradientTape`` and
``hvd.DistributedOptimizer`` (Keras 2); ``Compression.from_spec("topkc:ratio=0.01")`` builds
one from text. ``OPS`` is the TensorFlow implementation of the shared primitives. ``FrozenVarianceAdamW``: AdamW whose second moment
freezes after a warm-up (docs/optimizers.md).
"""
try:
    import tensorflow  # noqa: F401 - checked first, for the error below
except ImportError as exc:  # e.g. installed with the ``ddp`` extra, which brings PyTorch alone
    raise ImportError(
        "tf_backend needs TensorFlow (and Horovod to train with it), which this environment lacks: "
        "pip install 'hvd-gradcomp[tf]' (or '[tf-cpu]' on a CPU-only machine), or `make setup`. "
        "The PyTorch paths (torch_backend: Horovod, DDP, FSDP2, UpdateSync) do not need it.") from exc

from .compression import Compression, Compressor
from .ops import OPS
from .optim import FrozenVarianceAdamW

__all__ = ["Compression", "Compressor", "FrozenVarianceAdamW", "OPS"]
