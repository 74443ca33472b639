"""What a compressor saves, logged on rank 0: bytes per step against FP16, collectives per
step and the scheme's diagnostics (PyTorch). Definitions and units: :mod:`hvd_gradcomp.stats`.

Usage, with the compressor given to ``hvd.DistributedOptimizer``::

    compression = Compression.topkc(0.1)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression)
    stats = CompressionStats(compression, model.parameters(), every=100)
    for x, y in data:
        ...  # one optimizer step
        stats.step()      # every 100 steps, rank 0 logs (INFO) a line such as
    # step 100: topkc:ratio=0.1: 19,208 B/step sent, FP16 170,004 B/step (FP16/ours 8.85x); ...

Compress + decompress time is not reported (the compressor does not measure it; see
:mod:`hvd_gradcomp.stats`).
"""
import torch

from hvd_gradcomp.stats import StatsLogger, WireReport

__all__ = ["CompressionStats", "WireReport"]


class CompressionStats(StatsLogger):
    """Logs a PyTorch compressor's traffic against FP16 on rank 0 (:class:`StatsLogger`).

    Args:
        compression: the compressor passed as ``compression=`` (``torch_backend.Compression``).
        parameters: the parameters whose gradients it compresses (``model.parameters()``);
            those with ``requires_grad`` count for the FP16 baseline (2 bytes a coordinate).
        every: :meth:`step` logs after every ``every``-th call (0: only :meth:`log`).
        logger: a :class:`logging.Logger` (default ``hvd_gradcomp.stats``); lines are INFO.
        log_dir: a folder for TensorBoard scalars (``torch.utils.tensorboard``, which needs the
            ``tensorboard`` package), written by rank 0 at each log; None: none.
        rank: this process's rank; default: the compressor's (the DDP group's once
            ``register_comm_hook`` bound it, else Horovod's after ``hvd.init()``, else
            ``torch.distributed``'s default group's).

    Raises:
        TypeError: ``compression`` is not an hvd-gradcomp compressor.
        ValueError: ``every`` is negative, or ``rank`` is not given and no process group is
            initialised (neither ``hvd.init()`` nor ``torch.distributed.init_process_group()``).
    """

    def __init__(self, compression, parameters, *, every=0, logger=None, log_dir=None, rank=None):
        if rank is None and hasattr(compression, "codec"):
            rank = compression.codec.job_world()[1]
            if rank is None:
                raise ValueError("CompressionStats: this process's rank is unknown: neither hvd.init() "
                                 "nor torch.distributed.init_process_group() is done; pass rank=")
        coordinates = sum(p.numel() for p in parameters if p.requires_grad)
        super().__init__(compression, coordinates, every=every, logger=logger, log_dir=log_dir,
                         rank=rank)

    @staticmethod
    def _to_int(value) -> int:
        return int(value.item()) if isinstance(value, torch.Tensor) else int(value)

    def _open_writer(self, log_dir):
        from torch.utils.tensorboard import SummaryWriter
        return SummaryWriter(log_dir)

    def _write(self, writer, scalars, step):
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, step)
        writer.flush()

    def _close_writer(self, writer):
        writer.close()
