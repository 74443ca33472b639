"""TopKC: chunked Top-K whose chunks every rank agrees on, all-reduce only.

Steps (``selection="current"``, the default):
    1. Error feedback: ``c = g + e`` (flat float32 [d]), zero-padded to ``m * chunk`` with
       ``m = ceil(d / chunk)`` and viewed as ``m`` chunks of ``chunk`` coordinates.
    2. Score each chunk by its squared L2 norm (float32 [m]; NaN/inf scores count as 0).
    3. Side collective: all-reduce (Sum) the scores, so every rank holds the same vector.
    4. Select the ``k = max(1, ceil(ratio * m))`` chunks of highest aggregated score, ties by
       lower chunk index (a stable descending sort): the same chunks on every rank.
    5. Payload: the selected chunks packed densely in chunk-index order of the sort,
       ``k * chunk`` values, pre-scaled by 1/world_size and cast to ``payload_dtype``
       (float16 by default; the pre-scale keeps the fp16 sum in range, as in ``fp16``).
    6. Residual: ``e' = c - decode_local(payload)``: the unsent chunks and the fp16 rounding.
    7. Decompress: cast, undo the pre-scale, scatter the chunks into zeros, drop the padding.

Wire: payload ``k * chunk * itemsize(payload_dtype)`` bytes; side collective ``4 m`` bytes,
one per tensor per step (a latency each). No indices travel: every rank knows them.

``selection="previous"`` (no side collective): step 4 ranks chunks by the aggregated scores
of the *previous* step (kept in the state; all zeros before the first step, so step 0 takes
the first ``k`` chunks), and this step's scores ride at the end of the payload, normalised by
their maximum (so they fit fp16 and sum to at most world_size), to be used next step. The
trade-off: one collective's latency saved per tensor per step, ``m`` payload elements added,
and selection one step stale (error feedback catches what a stale choice misses).

Reference: the TopKC scheme of Han et al., "Beyond Throughput and Compression Ratios: Towards
High End-to-end Utility of Gradient Compression", HotNets 2024 (reconstructed; see
``shared/reference/algorithms.md``).
"""
from dataclasses import dataclass
from typing import NamedTuple

from .base import EmptyState, Scheme, TensorInfo, WireBytes, poison
from .primitives import itemsize
from .topk import check_ratio, num_selected

__all__ = ["TopKCConfig", "TopKCState", "TopKCScheme"]

# Smallest score norm used as a divisor: an all-zero tensor's max score is 0 (0/0 is NaN).
_TINY = 1e-30


@dataclass(frozen=True)
class TopKCConfig:
    """Options of :class:`TopKCScheme`.

    Attributes:
        ratio: fraction of chunks sent, in (0, 1]; default 0.01. Smaller compresses harder.
            Tuning: start at 0.01 with error feedback; halve it while the loss keeps up with
            the FP16 run.
        chunk: coordinates per chunk, >= 1; default 256. Larger chunks cost less side traffic
            (4 bytes per chunk) and select less precisely.
        error_feedback: keep what is not sent for the next step; default True.
        payload_dtype: "float16" (default) or "float32" for the packed chunks.
        selection: "current" (default; one extra small all-reduce of the scores per tensor)
            or "previous" (no extra collective; selection lags a step, see the module docs).
    """

    ratio: float = 0.01
    chunk: int = 256
    error_feedback: bool = True
    payload_dtype: str = "float16"
    selection: str = "current"

    def __post_init__(self):
        check_ratio("topkc", self.ratio)
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"topkc: chunk must be an integer >= 1, got {self.chunk!r}")
        if self.payload_dtype not in ("float16", "float32"):
            raise ValueError(f"topkc: payload_dtype must be 'float16' or 'float32', "
                             f"got {self.payload_dtype!r}")
        if self.selection not in ("current", "previous"):
            raise ValueError(f"topkc: selection must be 'current' or 'previous', "
                             f"got {self.selection!r}")


class TopKCState(NamedTuple):
    residual: object  # float32 [d]: error feedback (zeros when error_feedback=False)
    scores: object  # float32 [m]: previous step's aggregated chunk scores ("previous" only; else [0])


class TopKCScheme(Scheme):
    """Chunked TopK with rank-agreed chunks (module docstring)."""

    name = "topkc"

    def __init__(self, config: TopKCConfig = TopKCConfig()):
        self.config = config

    # Static sizes: m chunks, k selected, padding.
    def _sizes(self, info: TensorInfo):
        c = self.config.chunk
        m = -(-info.numel // c)
        return m, num_selected(self.config.ratio, m), m * c - info.numel

    def init(self, ops, info: TensorInfo, like):
        m, _, _ = self._sizes(info)
        if not self.config.error_feedback and self.config.selection == "current":
            return EmptyState()
        return TopKCState(ops.zeros((info.numel if self.config.error_feedback else 0,), "float32", like),
                          ops.zeros((m if self.config.selection == "previous" else 0,), "float32", like))

    def _side_name(self, info):
        return f"hvd_gradcomp.topkc.scores.{info.key}"

    def compress(self, ops, x, state, info, finite):
        cfg, n = self.config, info.world_size
        m, k, pad = self._sizes(info)
        # Step 1.
        corrected = ops.reshape(x, (info.numel,))
        if cfg.error_feedback:
            corrected = corrected + state.residual
        padded = ops.concat([corrected, ops.zeros((pad,), "float32", x)], 0) if pad else corrected
        chunks = ops.reshape(padded, (m, cfg.chunk))
        # Step 2.
        scores = ops.sum(chunks * chunks, 1)
        scores = ops.where(ops.isfinite(scores), scores, 0.0)
        # Steps 3-4.
        if cfg.selection == "current":
            ranking = ops.allreduce(scores, "sum", self._side_name(info))
        else:
            ranking = state.scores
        idx = ops.argsort(ranking)[:k]
        # Step 5: 1/n keeps the fp16 sum of n ranks in range.
        rows = ops.gather(chunks, idx) * (1.0 / n)
        payload = ops.cast(ops.reshape(rows, (k * cfg.chunk,)), cfg.payload_dtype)
        if cfg.selection == "previous":
            top = ops.maximum(ops.max(scores, None), _TINY)
            payload = ops.concat([payload, ops.cast(scores / top, cfg.payload_dtype)], 0)
        # Step 6.
        new_state = state
        if cfg.error_feedback:
            sent = ops.reshape(ops.cast(payload[:k * cfg.chunk], "float32"), (k, cfg.chunk)) * float(n)
            unsent = padded - ops.reshape(ops.scatter(idx, sent, (m, cfg.chunk)), (m * cfg.chunk,))
            new_state = state._replace(residual=unsent[:info.numel])
        return poison(ops, payload, finite), idx, new_state

    def decompress(self, ops, payload, ctx, info):
        cfg = self.config
        m, k, _ = self._sizes(info)
        # Step 7.
        rows = ops.reshape(ops.cast(payload[:k * cfg.chunk], "float32"), (k, cfg.chunk))
        dense = ops.scatter(ctx, rows * float(info.world_size), (m, cfg.chunk))
        return ops.reshape(dense, (m * cfg.chunk,))[:info.numel]

    # "previous" selection: the aggregated scores arrive with the payload.
    def absorb(self, ops, payload, ctx, state, info):
        """New state after the all-reduce (``selection="previous"`` only; else None)."""
        if self.config.selection != "previous":
            return None
        m, k, _ = self._sizes(info)
        agg = ops.cast(payload[k * self.config.chunk:], "float32")
        return state._replace(scores=ops.where(ops.isfinite(agg), agg, state.scores))

    def wire(self, info: TensorInfo) -> WireBytes:
        m, k, _ = self._sizes(info)
        size = itemsize(self.config.payload_dtype)
        if self.config.selection == "previous":
            return WireBytes((k * self.config.chunk + m) * size)
        return WireBytes(k * self.config.chunk * size, 4 * m, 1)
