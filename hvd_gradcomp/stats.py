"""What a compressor puts on the wire each step, against FP16: the numbers and the logged line.

Framework-free (plain Python numbers). :mod:`torch_backend.stats` and :mod:`tf_backend.stats`
subclass :class:`StatsLogger` with the framework's parts (turning a diagnostic tensor into an
int, TensorBoard) and give users ``CompressionStats`` (and, in Keras, a callback).

Definitions, per rank and per optimizer step, as handed to Horovod (the same counts as
``Compressor.bytes_per_step()`` and the TTA harness's ``MB/step``):

1. ``bytes_sent`` (bytes): the payloads of the per-tensor all-reduces, plus the side
   collectives that the papers' two-round variants post inside ``compress``, plus the sparse
   gradients Horovod gathers on its sparse path, around the compressor (embeddings without
   ``sparse_as_dense``; this rank's indices and values at their last step).
2. ``fp16_bytes`` (bytes): what Horovod's own ``Compression.fp16`` sends for the same dense
   gradients: 2 bytes per trainable coordinate.
3. ``fp16_ratio``: ``fp16_bytes / bytes_sent``; above 1 the compressor sends fewer bytes than
   FP16 (printed ``FP16/ours 8.80x``, as in the harness's tables).
4. ``collectives`` (per step): one payload all-reduce per tensor, plus the side collectives,
   plus the sparse gathers (2 per sparse gradient: indices, values). Horovod's tensor fusion may pack
   several payloads into one ring all-reduce; each side collective is waited for inside
   ``compress`` and costs at least one network latency of its own.
5. ``metrics`` (counts): the schemes' diagnostics (``Compressor.metrics()``) summed over
   tensors: ``saturated`` (THC: rotated coordinates clipped in the last step, on this rank)
   and ``realigned`` (TopKC, THC, PowerSGD: tensor-steps since the start whose output was 0
   because the ranks' states disagreed; 0 in a healthy run).

Not reported: compress + decompress time. The compressor object does not measure it (a timer
around every call would need a host synchronisation per tensor on a GPU, and in TensorFlow
``compress`` runs once, at trace time); the TTA harness times it with a proxy around the
compressor (``hvd_gradcomp.bench.worker.TimedCompressor``, and an in-graph timer in TF).
"""
import logging
from dataclasses import dataclass, field
from typing import Mapping, Optional

__all__ = ["FP16_BYTES_PER_COORDINATE", "WireReport", "summarize", "StatsLogger"]

# Horovod's fp16 compression casts every float gradient to float16: 2 bytes a coordinate.
FP16_BYTES_PER_COORDINATE = 2
_NOT_A_COMPRESSOR = ("stats: expected a compressor from torch_backend.Compression or "
                     "tf_backend.Compression (with wire_bytes(), bytes_per_step(), metrics()), "
                     "got {got!r}")


@dataclass(frozen=True)
class WireReport:
    """One compressor's traffic per step and per rank, against FP16 (module docs, 1.-5.).

    Attributes:
        spec: the compressor's text spec, e.g. ``"topkc:ratio=0.1"``.
        tensors: gradients compressed per step (tensors the compressor has seen).
        payload_bytes: bytes of their payload all-reduces, per step.
        side_bytes: bytes of the side collectives posted inside ``compress``, per step.
        side_collectives: number of those side collectives, per step.
        fp16_bytes: bytes the same gradients take as FP16 (2 per coordinate).
        metrics: ``{name: count}`` of the scheme's diagnostics summed over tensors.
        sparse_bytes: bytes of the sparse gradients' gathers (this rank), per step.
        sparse_collectives: those gathers, per step.
    """

    spec: str
    tensors: int
    payload_bytes: int
    side_bytes: int
    side_collectives: int
    fp16_bytes: int
    metrics: Mapping[str, int] = field(default_factory=dict)
    sparse_bytes: int = 0
    sparse_collectives: int = 0

    @property
    def bytes_sent(self) -> int:
        """Payload, side and sparse bytes per step (bytes)."""
        return self.payload_bytes + self.side_bytes + self.sparse_bytes

    @property
    def collectives(self) -> int:
        """Collectives handed to Horovod per step: payloads, side collectives, sparse gathers."""
        return self.tensors + self.side_collectives + self.sparse_collectives

    @property
    def fp16_ratio(self) -> Optional[float]:
        """``fp16_bytes / bytes_sent`` (> 1: fewer bytes than FP16); None before any step or
        without the FP16 baseline (no parameters counted)."""
        return self.fp16_bytes / self.bytes_sent if self.bytes_sent and self.fp16_bytes else None

    def line(self) -> str:
        """One line of text, e.g. ``topkc:ratio=0.1: 19,208 B/step sent, FP16 170,004 B/step
        (FP16/ours 8.85x); 6 collectives/step (6 payloads + 0 side); realigned 0``."""
        if not self.bytes_sent:
            return f"{self.spec}: no gradient compressed yet"
        sparse = (f" + {self.sparse_collectives} sparse gathers of {self.sparse_bytes:,} B"
                  if self.sparse_collectives else "")
        fp16 = (f"FP16 {self.fp16_bytes:,} B/step (FP16/ours {self.fp16_ratio:.2f}x)" if self.fp16_bytes
                else "FP16 unknown (no parameters counted)")
        text = (f"{self.spec}: {self.bytes_sent:,} B/step sent, {fp16}; {self.collectives} "
                f"collectives/step ({self.tensors} payloads + {self.side_collectives} side{sparse})")
        return text + "".join(f"; {name} {value}" for name, value in sorted(self.metrics.items()))

    def scalars(self) -> dict:
        """``{tag: float}`` for TensorBoard: ``compression/bytes_per_step``,
        ``compression/fp16_bytes_per_step``, ``compression/fp16_ratio`` (when defined),
        ``compression/collectives_per_step`` and ``compression/<metric>``."""
        out = {"compression/bytes_per_step": float(self.bytes_sent),
               "compression/fp16_bytes_per_step": float(self.fp16_bytes),
               "compression/collectives_per_step": float(self.collectives)}
        if self.fp16_ratio is not None:
            out["compression/fp16_ratio"] = self.fp16_ratio
        out.update({f"compression/{name}": float(v) for name, v in self.metrics.items()})
        return out


# Diagnostics that are bytes and steps of the sparse gathers, reported as bytes instead.
_SPARSE_METRICS = ("sparse_bytes", "sparse_steps")


def summarize(spec: str, wire_bytes: Mapping, coordinates: int,
              metrics: Mapping[str, Mapping[str, int]] = None, sparse_bytes: int = 0,
              sparse_collectives: int = 0) -> WireReport:
    """A :class:`WireReport` from a compressor's own accounts.

    Args:
        spec: the compressor's spec (``compressor.spec``).
        wire_bytes: ``compressor.wire_bytes()``: ``{key: WireBytes(payload, side,
            side_collectives)}``, bytes per step per tensor.
        coordinates: trainable coordinates whose gradients are compressed (int >= 0); the
            FP16 baseline is 2 bytes each.
        metrics: ``{key: {name: int}}``, the compressor's ``metrics()`` with each value
            already turned into a Python int (the backends do that); None: none. The sparse
            gradients' ``sparse_bytes``/``sparse_steps`` are left out (counted as bytes).
        sparse_bytes, sparse_collectives: ``compressor.bytes_per_step().sparse`` and
            ``.sparse_collectives`` (bytes and gathers per step; 0 without sparse gradients).

    Raises:
        ValueError: ``coordinates`` is negative or not an int.
    """
    if not isinstance(coordinates, int) or coordinates < 0:
        raise ValueError(f"stats: coordinates must be an int >= 0, got {coordinates!r}")
    totals = {}
    for per_tensor in (metrics or {}).values():
        for name, value in per_tensor.items():
            if name not in _SPARSE_METRICS:
                totals[name] = totals.get(name, 0) + int(value)
    return WireReport(spec=spec, tensors=len(wire_bytes),
                      payload_bytes=sum(w.payload for w in wire_bytes.values()),
                      side_bytes=sum(w.side for w in wire_bytes.values()),
                      side_collectives=sum(w.side_collectives for w in wire_bytes.values()),
                      fp16_bytes=FP16_BYTES_PER_COORDINATE * coordinates, metrics=totals,
                      sparse_bytes=int(sparse_bytes), sparse_collectives=int(sparse_collectives))


class StatsLogger:
    """Logs a compressor's :class:`WireReport` on rank 0 through :mod:`logging` (INFO), and
    optionally as TensorBoard scalars; the backends subclass it (``CompressionStats``).

    Args:
        compression: the compressor object passed to Horovod as ``compression=`` (from
            ``torch_backend.Compression`` or ``tf_backend.Compression``).
        coordinates: trainable coordinates whose gradients it compresses (the FP16 baseline
            is 2 bytes each); may be set later through the attribute of that name.
        every: :meth:`step` logs after every ``every``-th call; 0 (default): only :meth:`log`.
        logger: a :class:`logging.Logger`; default ``logging.getLogger("hvd_gradcomp.stats")``.
        log_dir: a folder for TensorBoard event files (rank 0 only); None (default): none.
        rank: this process's Horovod rank; only rank 0 logs and writes.

    Raises:
        TypeError: ``compression`` has no ``wire_bytes``/``bytes_per_step``/``metrics``
            (Horovod's own ``hvd.Compression.fp16``, say).
        ValueError: ``every`` is negative.
    """

    def __init__(self, compression, coordinates=0, *, every=0, logger=None, log_dir=None, rank=0):
        if not all(callable(getattr(compression, m, None)) for m in ("wire_bytes", "bytes_per_step", "metrics")):
            raise TypeError(_NOT_A_COMPRESSOR.format(got=compression))
        if not isinstance(every, int) or every < 0:
            raise ValueError(f"stats: every must be an int >= 0, got {every!r}")
        self.compression = compression
        self.coordinates = coordinates
        self.every = every
        self.logger = logger or logging.getLogger("hvd_gradcomp.stats")
        self.log_dir = log_dir
        self.rank = rank
        self.steps = 0  # calls of step()
        self._writer = None

    # ---- backend hooks ----
    @staticmethod
    def _to_int(value) -> int:
        """A 0-d diagnostic tensor as a Python int (a host read)."""
        return int(value)

    def _open_writer(self, log_dir):
        """A TensorBoard writer for ``log_dir``."""
        raise NotImplementedError

    def _write(self, writer, scalars: dict, step: int):
        """Write ``{tag: float}`` at ``step`` and flush."""
        raise NotImplementedError

    def _close_writer(self, writer):
        pass

    # ---- public ----
    def report(self) -> WireReport:
        """This rank's :class:`WireReport` now (reads the diagnostics: one host read each)."""
        c = self.compression
        metrics = {key: {name: self._to_int(v) for name, v in m.items()} for key, m in c.metrics().items()}
        total = c.bytes_per_step()
        return summarize(c.spec, c.wire_bytes(), int(self.coordinates), metrics,
                         getattr(total, "sparse", 0), getattr(total, "sparse_collectives", 0))

    def step(self) -> Optional[WireReport]:
        """Count one optimizer step; every ``every`` steps, :meth:`log` (else return None)."""
        self.steps += 1
        if self.every and self.steps % self.every == 0:
            return self.log(self.steps)
        return None

    def log(self, step: int = None, unit: str = "step") -> WireReport:
        """Log ``"<unit> <step>: <line>"`` (:meth:`WireReport.line`) on rank 0 and, when
        ``log_dir`` is set, write the scalars at ``step`` (default: the steps counted by
        :meth:`step`); returns this rank's report on every rank."""
        rep = self.report()
        if self.rank != 0:
            return rep
        step = self.steps if step is None else step
        self.logger.info("%s %d: %s", unit, step, rep.line())
        if self.log_dir is not None and rep.bytes_sent:
            if self._writer is None:
                self._writer = self._open_writer(self.log_dir)
            self._write(self._writer, rep.scalars(), step)
        return rep

    def close(self):
        """Close the TensorBoard writer, if any (logging stays usable)."""
        if self._writer is not None:
            self._close_writer(self._writer)
            self._writer = None
