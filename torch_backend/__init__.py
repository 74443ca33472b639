"""PyTorch frontend of hvd-gradcomp: ``from torch_backend import Compression``.

``Compression.<name>(**options)`` returns a compressor for ``hvd.DistributedOptimizer``;
``Compression.from_spec("topkc:ratio=0.01")`` builds one from text. ``OPS`` is the PyTorch
implementation of the shared primitives. ``FrozenVarianceAdamW``: AdamW whose second moment
freezes after a warm-up (docs/optimizers.md). ``UpdateSync``: each rank steps its own optimizer
and the ranks average the compressed parameter change (docs/update-sync.md). Without Horovod:
``torch_backend.ddp`` (DDP communication hooks), ``torch_backend.fsdp`` (FSDP2's all-reduce
across replicas) and ``torch_backend.lightning`` (a Lightning callback); docs/ddp.md,
docs/fsdp.md.
"""
from .compression import Compression, Compressor
from .ops import OPS
from .optim import FrozenVarianceAdamW
from .update_sync import UpdateSync

__all__ = ["Compression", "Compressor", "FrozenVarianceAdamW", "OPS", "UpdateSync"]
