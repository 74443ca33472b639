"""TopK with error feedback, sent as a dense masked tensor (the accuracy reference).

Steps:
    1. Error feedback: ``c = g + e`` (flat, float32).
    2. Select the ``k = max(1, ceil(ratio * d))`` coordinates of largest ``|c|`` (by magnitude,
       never by signed value). Each rank picks its own indices.
    3. Payload: ``c`` with every other coordinate zeroed, float32 [d]. A true sparse exchange
       of (index, value) pairs would need an all-gather, which this project rules out; under a plain
       all-reduce the masked tensor is the honest form, so **TopK saves no bandwidth**: it is
       the accuracy reference for TopKC.
    4. Residual: ``e' = c - payload`` (everything not sent), kept in ``ctx``.
    5. Decompress: the all-reduced payload is the result (sum or mean of the masked tensors).
    6. Finish: the residual becomes ``e'`` if the all-reduced payload is finite; otherwise
       (some rank's gradient held a NaN/inf, spread to every rank by ``poison``) it stays.

Wire: one all-reduce of d float32 (4d bytes), no side collective.

Reference: Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018; Lin et al.,
"Deep Gradient Compression", ICLR 2018.
"""
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from .base import EmptyState, Scheme, TensorInfo, WireBytes, payload_finite, poison
from .options import error_feedback_option, ratio_option, validate

__all__ = ["TopKConfig", "TopKState", "TopKScheme", "num_selected"]


def num_selected(ratio: float, n: int) -> int:
    """How many of ``n`` items a ratio keeps: ``max(1, ceil(ratio * n))`` (never 0, at most n)."""
    # The 1e-9 keeps ratio * n == 3.0000000000000004 from becoming 4.
    return min(n, max(1, math.ceil(ratio * n - 1e-9)))


@dataclass(frozen=True)
class TopKConfig:
    """Options of :class:`TopKScheme`, each declared once below (kind, range, default, which
    way compresses harder, doc: :mod:`hvd_gradcomp.options`; ``python -m hvd_gradcomp --list``
    lists them).

    Raises:
        ValueError: an option of the wrong kind or outside its range, naming the scheme and the
            option (one wording for every scheme), e.g. ``"topk: ratio must be a number in
            (0, 1], got -0.1"``.
    """

    SCHEME: ClassVar[str] = "topk"
    PRIMARY: ClassVar[str] = "ratio"  # the option a bare first value sets ("topk:VALUE")
    ratio: float = ratio_option(0.01, doc="fraction of coordinates kept per tensor (on the wire "
                                          "TopK stays dense: it saves no bytes)")
    error_feedback: bool = error_feedback_option()

    def __post_init__(self):
        validate(self)


class TopKState(NamedTuple):
    residual: object  # float32 [d]: error feedback, what was not sent so far


class TopKScheme(Scheme):
    """Magnitude TopK with error feedback, dense masked payload (module docstring)."""

    name = "topk"
    flattens = True  # a vector's math: a bucket's tensors go as one (buckets.py)

    def __init__(self, config: TopKConfig = TopKConfig()):
        self.config = config

    def init(self, ops, info: TensorInfo, like):
        if not self.config.error_feedback:
            return EmptyState()
        return TopKState(ops.zeros((info.numel,), "float32", like))

    def compress(self, ops, x, state, info, finite):
        d = info.numel
        flat = ops.reshape(x, (d,))
        # Step 1.
        corrected = flat + state.residual if self.config.error_feedback else flat
        # Step 2: by magnitude.
        idx = ops.top_k(ops.abs(corrected), num_selected(self.config.ratio, d))
        # Step 3.
        payload = ops.scatter(idx, ops.gather(corrected, idx), (d,))
        # Step 4.
        residual = corrected - payload if self.config.error_feedback else None
        return poison(ops, payload, finite), residual

    def decompress(self, ops, payload, ctx, info):
        return payload

    def finish(self, ops, payload, ctx, state, info):
        """Step 6: the residual moves on iff the all-reduced payload is finite."""
        if ctx is None:
            return state
        return TopKState(ops.select(payload_finite(ops, payload), lambda: ctx, lambda: state.residual))

    def wire(self, info: TensorInfo) -> WireBytes:
        return WireBytes(4 * info.numel)
