"""What a compressor saves, logged on rank 0: bytes per step against FP16, collectives per
step and the scheme's diagnostics (TensorFlow). Definitions and units: :mod:`hvd_gradcomp.stats`.

- :class:`CompressionStats` for a ``tf.GradientTape`` loop: call :meth:`~StatsLogger.step`
  once per step, or :meth:`~StatsLogger.log` when you want a line.
- :class:`CompressionStatsCallback` for Keras ``model.fit``: logs at the end of every epoch.
  Put it after Horovod's ``MetricAverageCallback``; only rank 0 logs::

      compression = Compression.thc()
      model.compile(hvd.DistributedOptimizer(opt, compression=compression), ...)
      model.fit(..., callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                hvd.callbacks.MetricAverageCallback(),
                                CompressionStatsCallback(compression)])

Compress + decompress time is not reported (the compressor does not measure it; see
:mod:`hvd_gradcomp.stats`).
"""
import tensorflow as tf

from hvd_gradcomp.stats import StatsLogger, WireReport

__all__ = ["CompressionStats", "CompressionStatsCallback", "WireReport"]


def _coordinates(variables) -> int:
    return sum(int(v.shape.num_elements()) for v in variables)


def _default_rank():
    import horovod.tensorflow as hvd
    return hvd.rank()


class CompressionStats(StatsLogger):
    """Logs a TensorFlow compressor's traffic against FP16 on rank 0 (:class:`StatsLogger`).

    Call it eagerly (outside ``tf.function``): reading the diagnostics is a host read.

    Args:
        compression: the compressor passed as ``compression=`` (``tf_backend.Compression``).
        variables: the trainable variables whose gradients it compresses
            (``model.trainable_variables`` of a built model); FP16 baseline: 2 bytes a
            coordinate. Empty (a model not built yet): the lines say the baseline is unknown;
            set ``stats.coordinates`` later.
        every: :meth:`step` logs after every ``every``-th call (0: only :meth:`log`).
        logger: a :class:`logging.Logger` (default ``hvd_gradcomp.stats``); lines are INFO.
        log_dir: a folder for TensorBoard scalars (``tf.summary``), written by rank 0 at
            each log; None: none.
        rank: this process's rank; default ``horovod.tensorflow.rank()`` (after ``hvd.init()``).

    Raises:
        TypeError: ``compression`` is not an hvd-gradcomp compressor.
        ValueError: ``every`` is negative.
    """

    def __init__(self, compression, variables=(), *, every=0, logger=None, log_dir=None, rank=None):
        super().__init__(compression, _coordinates(variables), every=every, logger=logger,
                         log_dir=log_dir, rank=_default_rank() if rank is None else rank)

    @staticmethod
    def _to_int(value) -> int:
        return int(value.numpy()) if hasattr(value, "numpy") else int(value)

    def _open_writer(self, log_dir):
        return tf.summary.create_file_writer(log_dir)

    def _write(self, writer, scalars, step):
        with writer.as_default():
            for tag, value in scalars.items():
                tf.summary.scalar(tag, value, step=step)
        writer.flush()

    def _close_writer(self, writer):
        writer.close()


class CompressionStatsCallback(tf.keras.callbacks.Callback):
    """Keras callback: at the end of every epoch, rank 0 logs the compressor's traffic against
    FP16 (the model's trainable variables give the FP16 baseline) and, with ``log_dir``,
    writes it as TensorBoard scalars at step ``epoch + 1``.

    Args:
        compression: the compressor given to ``hvd.DistributedOptimizer(compression=...)``.
        logger, log_dir, rank: as for :class:`CompressionStats`.

    Attributes:
        stats: the :class:`CompressionStats` it logs with.
        reports: this rank's :class:`~hvd_gradcomp.stats.WireReport` of every epoch, in order.

    Raises:
        TypeError: ``compression`` is not an hvd-gradcomp compressor.
    """

    def __init__(self, compression, *, logger=None, log_dir=None, rank=None):
        super().__init__()
        self.stats = CompressionStats(compression, (), logger=logger, log_dir=log_dir, rank=rank)
        self.reports = []

    def on_epoch_end(self, epoch, logs=None):
        self.stats.coordinates = _coordinates(self.model.trainable_variables)
        self.reports.append(self.stats.log(step=epoch + 1, unit="epoch"))

    def on_train_end(self, logs=None):
        self.stats.close()
