"""TopKC: chunked Top-K whose chunks every rank agrees on, one all-reduce per tensor.

Steps of ``compress`` (``selection="previous"``, the default; ``d`` coordinates, world size
``n``, ``m = ceil(d / chunk)`` chunks, ``k = max(1, ceil(ratio * m))`` of them sent):
    1. Error feedback: ``c = g + beta e`` (flat float32 [d]; ``beta`` is ``residual_decay``,
       default 1: plain error feedback, ``c = g + e``), zero-padded to ``m * chunk`` and
       viewed as ``m`` chunks of ``chunk`` coordinates.
    2. Select the ``k`` chunks of highest *agreed* score, ties by lower chunk index (a stable
       descending sort). The agreed scores are the all-reduced scores of the previous step
       (step 6), which every rank received in the same payload and kept in its state, so
       every rank selects the same chunks without any collective inside ``compress``. Before
       the first step all scores are 0 and the first ``k`` chunks go. With ``max_age`` (below)
       the chunks left unsent for ``max_age`` steps go first.
    3. Payload values: the selected chunks packed densely, ``k * chunk`` values pre-scaled by
       1/n (so n ranks' float16 sum stays in range, as in ``fp16``; not where NCCL's Average
       divides by n itself, :attr:`~hvd_gradcomp.base.TensorInfo.prescale`) and cast to
       ``payload_dtype`` with saturation at the largest float16 <= 65504 / n, so that no
       finite gradient makes the n-rank sum inf (the excess stays in error feedback).
    4. Residual: ``e' = c`` with the sent values (as decoded) subtracted from the selected
       chunks: unsent chunks, fp16 rounding and anything the saturation cut.
    5. Scores for the next step: the squared L2 norm of each chunk of ``g + beta e'``, the best
       guess this rank has of next step's corrected gradient (next ``c`` is next ``g`` plus
       ``beta e'``): a chunk just sent starts again from its gradient alone, and a chunk left
       unsent keeps what it owes (scores of ``c`` itself would re-select the chunks the step
       has just flushed; the comparison of score choices: docs/bench.md, "TopKC").
       Normalised by their maximum (non-finite as 0), cast to ``payload_dtype``, appended to
       the payload: ``m`` values.
    6. A vote: 16 values, 1 in the slot of a hash of this rank's selected chunks (in their
       packing order), 0 elsewhere.
       Horovod all-reduces ``[values..., scores..., votes...]`` (Sum or Average; a rank in
       ``hvd.join()`` contributes zeros, so no vote).

If more than one slot holds votes, the ranks selected different chunks (a rank whose state is
not the others': a checkpoint loaded on one rank only, a rank back from ``hvd.join()``):
``decompress`` returns 0 for the tensor (never a wrong sum), ``finish`` gives every rank back
what it sent (its residual becomes all of ``c``), the scores realign to the all-reduced ones
on every rank, and ``metrics()["realigned"]`` counts the step. Two different selections go
unseen only when their hashes share a slot (1 in 16); the next step realigns them anyway,
since every rank then holds the same scores.

Age bound (``max_age`` = ``A`` > 0; 0, the default, is off and changes nothing). A chunk of
low agreed score can go unsent for hundreds of steps while its residual grows, then arrive as
one burst (on ``lm-comm`` at ratio 0.1 the longest wait was 287 steps, though half the chunks
went within 6); issue 34 asked whether bounding that delay is what TopKC lacks under Adam.
Measured there (docs/adam.md, "TopKC's age bound"): at ``A = 2 / ratio`` the longest wait fell
to 25 steps for 11% of the slots, and the steps to FP16's perplexity did not move, hence off
by default. Each chunk's *age*
(int64 [m], the state's ``age``) counts the completed steps since it was last sent (0 at the
start). Step 2 then ranks the chunks of age >= ``A`` first, oldest first (ties by lower
index), then the rest by agreed score (ties by lower index), and takes the first ``k``: one
stable descending sort of the key ``age + max(scores) + 1`` for a due chunk and its agreed
score otherwise (exact in float32 while ages and the summed scores stay below 2**24). After
the all-reduce (a finite payload, one selection): the selected chunks' ages become 0, every
other chunk's grows by 1. The ages follow from the agreed selection alone, so they are the same
on every rank without any collective and without a byte on the wire; a non-finite step leaves
them as they were (with the residual and the scores), and a split vote (ranks that selected
differently, hence held different ages or scores) restarts every rank's ages at 0, as the
scores realign to the all-reduced ones: agreed again from the next step. The bound: a chunk
due at age ``A`` has at most ``m - 1`` chunks ahead of it, only those leave the order ahead of
it (a chunk sent restarts at 0, below it; a younger chunk stays younger), and ``k`` of them go
each step it is not taken, so it is sent at age at most ``A + ceil(m / k) - 1``, and at age
``A`` when at most ``k`` chunks are due at once (the start, where every chunk's age counts from
0 together, is the worst case). ``A`` about ``2 / ratio`` leaves at least half of the ``k`` slots
to the scores in the steady state (each chunk needs a slot every ``A`` steps at most: ``m / A``
= ``k / 2`` a step). The steps of an FP16 warm-up and of a failed step are not counted; after a
realignment the count restarts. Composes with ``residual_decay`` (which bounds what a chunk
owes, where this bounds how long it waits) and with the FP16 warm-up (the ages start at 0 at
the hand-over); refused with EF21 and with ``selection="current"``. The selection is what the
other ranks see, so ranks must all run with the same ``max_age`` (the vote catches a rank that
does not, like any other disagreement). Not in the papers followed here: a round-robin floor
under a score-based sparsifier, in the spirit of the bounded staleness that error-feedback
analyses assume (Stich et al., NeurIPS 2018, bound the delay through the contraction instead).

Residual decay (``residual_decay`` = ``beta`` < 1): what a chunk owes is carried at ``beta``
times its value each step, so it is at most about ``1 / (1 - beta)`` steps of its gradient (20
at 0.95) instead of everything since the chunk was last sent. Why: at a small ratio each chunk
is sent about every ``1 / ratio`` steps, and plain error feedback then delivers those steps'
gradient as one burst, applied at once and carried on by SGD momentum: the coordinates take
one step ``1 / ratio`` times too large, long after the gradient that asked for it, and
training oscillates or diverges. The price: a chunk that stays unsent loses part of its
gradient (the compressor is then biased, as GRACE's residual memory with ``beta`` < 1, Xu et
al., ICDCS 2021). Under Adam, whose per-coordinate steps already tame the bursts, it does
not help, which is why the default stays 1 (measurements with SGD and with Adam:
docs/bench.md, "Small ratios and residual_decay"). Nothing on the wire changes, and
nothing needs agreeing: the residual is this rank's own. DGC's answers to the same staleness
(Lin et al., ICLR 2018: a warm-up of the ratio, momentum correction with factor masking) are
not implemented: a warm-up changes the payload's size with the step (one TensorFlow trace per
size, and a rank back from ``hvd.join()`` would disagree on it), momentum correction needs
the optimizer's momentum turned off; ``docs/bench.md`` ("TopKC") compares them. (The FP16
warm-up, ``fp16_warmup=N`` of :mod:`hvd_gradcomp.warmup`, changes the size once, at a step
every rank of the process set took part in and decided alike.)

EF21 (``error_feedback="ef21"``; Richtarik, Sokolov, Fatkhullin, "EF21: A New, Simpler,
Theoretically Better, and Practically Faster Error Feedback", NeurIPS 2021). Classic error
feedback under Adam delivers each chunk as a burst of ~1/ratio steps' gradient every ~1/ratio
steps (docs/adam-compression.md); EF21 delivers a dense running estimate instead. State:
``h_i`` (``local``, float32 [d], this rank's) and ``H`` (``estimate``, float32 [d], the same on
every rank), the agreed ``scores``, a ``step`` counter. Per step, with the selection of step 2:
    - ``c = g_i - h_i``; the payload's values are ``C_i`` = ``c`` on the selected chunks (as in
      step 3: pre-scaled by 1/n, saturating cast), then the scores, then the vote;
    - the scores are the squared chunk norms of ``c`` with the selected chunks replaced by
      what sending leaves of them (``g_i - h_i'``: fp16 rounding, saturation), normalised by
      their maximum: chunks whose gradient moved away from the estimate are sent next;
    - the vote hashes the selection *and* ``step`` (a rank that missed steps, e.g. back from
      ``hvd.join()``, disagrees even when its selection coincides);
    - after the all-reduce: ``H' = H + `` the decoded C's (their sum under Sum, their mean
      under Average: linear in the payload, so the op need not be known) is the output, dense
      and never bursty; ``h_i' = h_i + C_i`` (as decoded), ``step + 1``, scores as step 6.
      Every rank adds the same all-reduced values, so ``H`` stays agreed; ``H`` is the sum
      (mean) of the ``h_i`` up to the rounding of the all-reduce's own float16 additions.
      A rank in ``hvd.join()`` contributes zeros: its ``h_i`` does not move and ``H`` still
      counts it.
    - a split vote: the output is 0 (never a wrong value) and every rank restarts ``h_i``,
      ``H`` and ``step`` at 0 (the same on every rank), scores from the payload; from the
      next step the ranks agree again (``H`` fills again as chunks are sent; ``metrics()``
      counts it). A non-finite payload leaves everything as it was.
    ``local`` and ``estimate`` are the rank-local fields: a checkpoint loaded on another
    number of ranks restarts both at 0 (keeping ``H`` the sum/mean of the ``h_i``); scores and
    step are kept. Wire: unchanged. Cost: two passes over ``d`` more than classic error
    feedback (``H`` and ``h_i`` updates); ``residual_decay`` and ``selection="current"`` are
    refused with it. After an FP16 warm-up (:mod:`hvd_gradcomp.warmup`) ``h_i`` starts at the
    rank's decoded gradient and ``H`` at the aggregate (:meth:`TopKCScheme.hand_over`).

``decompress``: cast, undo the pre-scale, scatter the chunks into zeros, drop the padding.
``finish``: if the all-reduced payload is finite, the residual becomes ``e'`` and the agreed
scores become the payload's score part; otherwise (some rank's gradient held a NaN/inf, which
:func:`~hvd_gradcomp.base.poison` spread to every rank's payload) both stay as they were, on
every rank.

Wire: one all-reduce of ``(k * chunk + m + 16) * itemsize(payload_dtype)`` bytes; nothing else.

``selection="current"`` is the paper's two-round form (blocking): step 2 ranks chunks by this
step's scores of ``c``, summed across ranks by a synchronous side all-reduce inside
``compress`` (``4 m`` bytes, one latency per tensor per step); the payload is the values only.
It needs every rank to compress every tensor in the same order: an unused parameter, a
rank-dependent graph or ``hvd.join()`` makes it fail (PyTorch: after
``HVD_GRADCOMP_SIDE_TIMEOUT`` seconds on every rank; immediately on a rank whose gradient
Horovod fills in), where the default completes.

The scheme compresses every tensor it is given, whatever its size: which tensors reach it is
the routing's decision (:mod:`hvd_gradcomp.routing`; a plain ``topkc`` compressor sends
tensors below ``min_numel``, default 1024, as FP16 instead: their chunk scores and selection
would cost more than they save).

Reference: the TopKC scheme of Han et al., "Beyond Throughput and Compression Ratios: Towards
High End-to-end Utility of Gradient Compression", HotNets 2024 (reconstructed from the
paper); error feedback after Stich et al., NeurIPS 2018.
"""
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from . import composite
from .base import EmptyState, Scheme, TensorInfo, WireBytes, commit, payload_finite, poison, saturating_cast
from .primitives import itemsize
from .options import error_feedback_option, option, ratio_option, validate, wire_dtype_option
from .topk import num_selected
from .topkc_kernels import (_SLOTS, _TINY, _correct_kernel, _pack_kernel, _rescored, _scatter_kernel,  # noqa: F401
                            _top_kernel, _unit_scores, _vote_slots)

__all__ = ["TopKCConfig", "TopKCState", "TopKCAgedState", "TopKCEF21State", "TopKCScheme"]



@dataclass(frozen=True)
class TopKCConfig:
    """Options of :class:`TopKCScheme`, each declared once below (kind, range, default, which
    way compresses harder, doc: :mod:`hvd_gradcomp.options`; ``python -m hvd_gradcomp --list``
    lists them).

    Tuning ``ratio``: start at 0.1 with error feedback; lower it while the loss keeps up with
    the FP16 run. With SGD and momentum at ratios of 0.01 and below, set
    ``residual_decay=0.95`` (module docstring: plain error feedback then delivers bursts of
    ~1/ratio steps' gradient; measured in docs/bench.md). ``chunk``: larger chunks cost fewer
    score values on the wire (one per chunk) and select less precisely, so it moves the bytes both ways. ``payload_dtype`` is the dtype
    of the compressed payload (PowerSGD's ``uncompressed_dtype`` is the dtype of the tensors
    it leaves uncompressed). ``selection="current"`` is the paper's blocking two-round form
    (module docstring). ``max_age``: a hard bound on how long a chunk waits, at no cost in bytes;
    about ``2 / ratio`` (20 at 0.1) leaves most of the chunks sent to the scores (module
    docstring, "Age bound"), ``1 / ratio`` or less turns the selection into a round-robin. 0
    (the default) is off: on the LM under Adam it did not change the steps (docs/adam.md).

    The size threshold below which tensors go as FP16 (``min_numel``) is a routing option,
    not one of these (:mod:`hvd_gradcomp.routing`).

    Raises:
        ValueError: an option of the wrong kind or outside its range, naming the scheme and the
            option (one wording for every scheme), e.g. ``"topkc: chunk must be an integer
            >= 1, got 0"``.
    """

    SCHEME: ClassVar[str] = "topkc"
    PRIMARY: ClassVar[str] = "ratio"  # the option a bare first value sets ("topkc:VALUE")
    ratio: float = ratio_option(0.01, doc="fraction of chunks sent per tensor and step")
    chunk: int = option(256, kind="integer", lo=1,
                        doc="coordinates per chunk (larger: fewer scores, coarser selection)")
    error_feedback: object = error_feedback_option(
        "keep what is not sent and add it to the next step's gradient (ef21: send the change "
        "of a running estimate; the output is dense)", variants=("ef21",))
    payload_dtype: str = wire_dtype_option("dtype of the packed chunks and scores on the wire")
    selection: str = option("previous", kind="choice", choices=("previous", "current"),
                            harder="previous",
                            doc="chunks chosen by the previous step's agreed scores (one "
                                "all-reduce) or this step's (blocking side all-reduce)")
    residual_decay: float = option(1.0, kind="number", lo=0.0, hi=1.0, lo_open=True,
                                   doc="factor on the carried residual each step (1: plain error "
                                       "feedback; < 1 bounds what a rarely sent chunk owes)")
    ef21_momentum: float = option(1.0, kind="number", lo=0.0, hi=1.0, lo_open=True,
                                  doc="EF21-M: each rank compresses v_i = (1 - a) v_i + a g_i "
                                      "instead of g_i (1: plain EF21; error_feedback=ef21 only)")
    max_age: int = option(0, kind="integer", lo=0,
                          doc="chunks unsent for this many steps go first, oldest first (0: off; "
                              "about 2/ratio bounds every chunk's wait)")

    def __post_init__(self):
        validate(self)
        if self.residual_decay != 1.0 and self.error_feedback is not True:
            raise ValueError(f"topkc: residual_decay={self.residual_decay} needs error_feedback=True "
                             f"(it decays the error feedback's residual), got "
                             f"error_feedback={self.error_feedback!r}")
        if self.ef21_momentum != 1.0 and self.error_feedback != "ef21":
            raise ValueError(f"topkc: ef21_momentum={self.ef21_momentum} needs error_feedback='ef21', "
                             f"got error_feedback={self.error_feedback!r}")
        if self.max_age and (self.error_feedback == "ef21" or self.selection != "previous"):
            raise ValueError(f"topkc: max_age={self.max_age} needs selection='previous' and classic "
                             f"error feedback (the ages follow the agreed selection of the previous "
                             f"step's scores), got selection={self.selection!r}, "
                             f"error_feedback={self.error_feedback!r}")
        if self.error_feedback == "ef21" and self.selection != "previous":
            raise ValueError("topkc: error_feedback='ef21' needs selection='previous': its rank-agreed "
                             "estimate realigns through the payload's votes, which the blocking "
                             "'current' form does not carry")


class TopKCState(NamedTuple):
    residual: object  # float32 [d]: error feedback ([0] when error_feedback=False)
    scores: object  # float32 [m]: agreed chunk scores from the last step ("previous"; else [0])
    realigned: object  # int64 []: steps whose output was 0 because ranks selected differently


class TopKCAgedState(NamedTuple):
    """:class:`TopKCState` with the chunks' ages (``max_age`` > 0: module docstring, "Age
    bound"); a state of its own so that checkpoints without ``max_age`` keep their fields."""

    residual: object  # float32 [d]: error feedback ([0] when error_feedback=False)
    scores: object  # float32 [m]: agreed chunk scores from the last step
    realigned: object  # int64 []: steps whose output was 0 because ranks selected differently
    age: object  # int64 [m]: completed steps since each chunk was last sent (agreed on every rank)


class TopKCEF21State(NamedTuple):
    local: object  # float32 [d]: h_i, this rank's running estimate of its gradient (rank-local)
    estimate: object  # float32 [d]: H, the all-reduced estimate (sum or mean of the h_i); the output
    scores: object  # float32 [m]: agreed chunk scores from the last step
    step: object  # int64 []: steps since the start or the last realignment (in the vote)
    realigned: object  # int64 []: steps whose output was 0 because ranks disagreed
    momentum: object  # float32 [d]: EF21-M's v_i (rank-local; [0] when ef21_momentum = 1)


class _EF21Ctx(NamedTuple):
    idx: object  # int64 [k]: the selected chunks
    sent: object  # float32 [k, chunk]: this rank's C(g_i - h_i) on them, as decoded
    estimate: object  # the state's H
    momentum: object  # EF21-M: this step's v_i (None for plain EF21)
    split: object = None  # bool []: set by receive
    ok: object = None  # bool []: set by receive
    new: object = None  # float32 [d]: H + the all-reduced C's (times 0 after a split); set by receive


class _TopKCCtx(NamedTuple):
    idx: object  # int64 [k]: the selected chunks
    left: object  # float32 [m * chunk]: e' padded (None without error feedback)
    sent: object  # float32 [k, chunk]: what this rank sent, decoded (None without error feedback)
    # Set by receive, from the all-reduced payload:
    split: object = None  # bool []: the ranks voted for more than one selection ("previous" only)
    ok: object = None  # bool []: the all-reduced payload is finite



class TopKCScheme(Scheme):
    """Chunked TopK with rank-agreed chunks (module docstring)."""

    name = "topkc"
    # Tensors below this many coordinates go as fp16 (routing): TopKC's 16 vote slots and
    # chunk padding outweigh its saving on them.
    min_numel = 1024

    def __init__(self, config: TopKCConfig = TopKCConfig()):
        self.config = config
        self.blocking = config.selection == "current"
        self.ef21 = config.error_feedback == "ef21"
        # A bucket's tensors go as one vector (buckets.py), except under EF21, whose estimates
        # are kept per tensor.
        self.flattens = not self.ef21
        # Classic: the residual; EF21: h_i and H together (a checkpoint loaded on another
        # number of ranks restarts both at 0, which keeps H the sum/mean of the h_i).
        self.rank_local_fields = ("local", "estimate", "momentum") if self.ef21 else ("residual",)

    # Static sizes: m chunks, k selected, padding.
    def _sizes(self, info: TensorInfo):
        c = self.config.chunk
        m = -(-info.numel // c)
        return m, num_selected(self.config.ratio, m), m * c - info.numel

    def init(self, ops, info: TensorInfo, like):
        cfg = self.config
        if self.ef21:
            m, _, _ = self._sizes(info)
            zero = ops.zeros((), "int64", like)
            return TopKCEF21State(ops.zeros((info.numel,), "float32", like),
                                  ops.zeros((info.numel,), "float32", like),
                                  ops.zeros((m,), "float32", like), zero, zero,
                                  ops.zeros((info.numel if cfg.ef21_momentum != 1.0 else 0,), "float32", like))
        if not cfg.error_feedback and self.blocking:
            return EmptyState()
        m, _, _ = self._sizes(info)
        state = TopKCState(ops.zeros((info.numel if cfg.error_feedback else 0,), "float32", like),
                           ops.zeros((0 if self.blocking else m,), "float32", like),
                           ops.zeros((), "int64", like))
        return TopKCAgedState(*state, ops.zeros((m,), "int64", like)) if cfg.max_age else state

    def _side_name(self, info):
        return f"hvd_gradcomp.topkc.scores.{info.key}"

    def compress(self, ops, x, state, info, finite):
        if self.ef21:
            return self._ef21_compress(ops, x, state, info, finite)
        cfg = self.config
        _, k, _ = self._sizes(info)
        flat = ops.reshape(x, (info.numel,))
        plan = (cfg.chunk, cfg.error_feedback, self.blocking, cfg.residual_decay)
        if not self.blocking:  # step 2 first: the selection is known before the pass over c
            idx = self._select(ops, state, k)
        # Step 1 (and the scores, step 5 or the blocking step 2) in one fused kernel.
        chunks, scores = ops.fuse(_correct_kernel, plan)(flat, state.residual if cfg.error_feedback else flat)
        if self.blocking:
            ranking = ops.allreduce(scores, "sum", self._side_name(info), info.group)
            idx = ops.fuse(_top_kernel, k)(ranking)
        # Steps 3-6 on the selected chunks in one fused kernel.
        pack = (cfg.chunk, cfg.error_feedback, self.blocking, cfg.residual_decay, cfg.payload_dtype,
                info.prescale, info.unscale, info.fp16_limit)
        payload, sent, left = ops.fuse(_pack_kernel, pack)(flat, chunks, scores, idx,
                                                           *(() if finite is None else (finite,)))
        if not cfg.error_feedback:
            sent = left = None
        return payload, _TopKCCtx(idx, left, sent)

    def _select(self, ops, state, k):
        """int64 [k]: step 2's chunks, from the agreed ``scores`` (float32 [m]) and, with
        ``max_age``, the agreed ``age`` (int64 [m]): due chunks first, oldest first, then by
        score; ties by lower index (the stable descending argsort)."""
        if not self.config.max_age:
            return ops.fuse(_top_kernel, k)(state.scores)
        due = state.age >= self.config.max_age
        above = ops.max(state.scores, None) + 1.0  # every due key ranks above every score
        key = ops.where(due, ops.cast(state.age, "float32") + above, state.scores)
        return ops.fuse(_top_kernel, k)(key)

    def _aged(self, ops, age, idx, split):
        """int64 [m]: the ages after a step that sent chunks ``idx``: 0 for them, + 1 for the
        others; all 0 after a split vote (``split`` bool [])."""
        grown = ops.index_add(age + 1, idx, ops.gather(age, idx) * -1 - 1)
        return ops.where(split, grown * 0, grown)

    def _ef21_compress(self, ops, x, state, info, finite):
        """EF21 (module docstring, "EF21"): payload ``[C(g_i - h_i) / n, scores, vote]``."""
        cfg = self.config
        m, k, pad = self._sizes(info)
        idx = ops.fuse(_top_kernel, k)(state.scores)
        g = ops.reshape(x, (info.numel,))
        v = None
        if cfg.ef21_momentum != 1.0:  # EF21-M: the local momentum stands in for the gradient
            a = cfg.ef21_momentum
            v = g = state.momentum * (1.0 - a) + g * a
        c = g - state.local
        if pad:
            c = ops.concat([c, ops.zeros((pad,), "float32", c)], 0)
        chunks = ops.reshape(c, (m, cfg.chunk))
        picked = ops.gather(chunks, idx)
        wire = saturating_cast(ops, picked * info.prescale, cfg.payload_dtype, limit=info.fp16_limit)
        sent = ops.cast(wire, "float32") * info.unscale
        # Next step's scores: ||g - h_i'|| per chunk with this step's g, i.e. c with the sent
        # chunks' remainder (fp16 rounding, saturation) in place of the selected rows.
        norms = ops.norm(chunks, 1)
        scores = _unit_scores(ops, _rescored(ops, norms * norms, idx, picked - sent))
        payload = ops.concat([ops.reshape(wire, (k * cfg.chunk,)), ops.cast(scores, cfg.payload_dtype),
                              _vote_slots(ops, idx, cfg.payload_dtype, state.step)], 0)
        return poison(ops, payload, finite), _EF21Ctx(idx, sent, state.estimate, v)

    def receive(self, ops, payload, ctx, info):
        """``ctx`` with ``ok`` (the payload is finite) and, ``selection="previous"``, ``split``
        (bool []: the ranks that contributed voted for more than one selection): read once
        from the all-reduced payload for decompress and finish, the same on every rank."""
        if self.blocking:  # without error feedback it keeps no state: nothing to decide
            return ctx._replace(ok=payload_finite(ops, payload)) if self.config.error_feedback else ctx
        voted = ops.cast(payload[self._votes_at(info):], "float32") != 0.0
        split, ok = ops.count(voted, None) > 1, payload_finite(ops, payload)
        if self.ef21:
            return ctx._replace(split=split, ok=ok, new=ctx.estimate + self._dense(ops, payload, ctx.idx, split, info))
        return ctx._replace(split=split, ok=ok)

    def _votes_at(self, info):
        m, k, _ = self._sizes(info)
        return k * self.config.chunk + m

    def _dense(self, ops, payload, idx, split, info):
        """float32 [d]: the all-reduced chunks (EF21: the C's) scattered into zeros, times 0
        after a split (``split`` None: no vote, ``selection="current"``). Times 0, not a plain
        0: a NaN from a failed rank must still reach the output."""
        plan = (self.config.chunk, info.numel, info.unscale, self.config.payload_dtype)
        return ops.fuse(_scatter_kernel, plan)(payload, idx, *(() if split is None else (split,)))

    def decompress(self, ops, payload, ctx, info):
        if self.ef21:  # H' = H + the all-reduced C's; 0 after a split (NaN stays NaN)
            return ctx.new * ops.where(ctx.split, 0.0, 1.0)
        # Ranks that selected different chunks ("previous"): 0, never a wrong sum; "current"
        # sets no split.
        return self._dense(ops, payload, ctx.idx, ctx.split, info)

    def finish(self, ops, payload, ctx, state, info):
        """Residual, agreed scores and (``max_age``) ages move on iff the all-reduced payload
        is finite; after a split vote each rank keeps all of ``c`` (nothing was applied), the
        scores realign and the ages restart at 0."""
        if not len(state):
            return state
        if self.ef21:
            return self._ef21_finish(ops, payload, ctx, state, info)
        cfg = self.config
        m, k, pad = self._sizes(info)
        ok, split = ctx.ok, ctx.split
        new = state
        if ctx.left is not None:
            left = ctx.left
            if split is not None:  # give back what was sent: an O(k chunk) update
                chunks = ops.reshape(left, (m, cfg.chunk))
                left = ops.reshape(ops.index_add(chunks, ctx.idx, ctx.sent * ops.cast(split, "float32")),
                                   (m * cfg.chunk,))
            left = left[:info.numel] if pad else left
            new = new._replace(residual=ops.select(ok, lambda: left, lambda: state.residual))
        if split is not None:
            scores, realigned = ops.select(
                ok, lambda: (ops.cast(payload[k * cfg.chunk:self._votes_at(info)], "float32"),
                             state.realigned + ops.cast(split, "int64")),
                lambda: (state.scores, state.realigned))
            new = new._replace(scores=scores, realigned=realigned)
            if cfg.max_age:
                new = new._replace(age=ops.select(ok, lambda: self._aged(ops, state.age, ctx.idx, split),
                                                  lambda: state.age))
        return new

    def _ef21_finish(self, ops, payload, ctx, state, info):
        """h_i += C(g_i - h_i), H := H + the all-reduced C's, step + 1; after a split every
        rank restarts h_i, H and the step at 0 (the same on every rank); the scores realign
        either way; nothing moves when the payload is not finite."""
        cfg = self.config
        m, k, _ = self._sizes(info)
        scores = ops.cast(payload[k * cfg.chunk:self._votes_at(info)], "float32")

        momentum = state.momentum if ctx.momentum is None else ctx.momentum

        def moved():
            sent = ops.reshape(ops.scatter(ctx.idx, ctx.sent, (m, cfg.chunk)), (m * cfg.chunk,))[:info.numel]
            return TopKCEF21State(state.local + sent, ctx.new, scores, state.step + 1, state.realigned,
                                  momentum)

        def restarted():  # v_i is this rank's own: it goes on
            zero = state.local * 0.0
            return TopKCEF21State(zero, zero, scores, state.step * 0, state.realigned + 1, momentum)

        return commit(ops, ctx.ok, ops.select(ctx.split, restarted, moved), state)

    def hand_over(self, ops, state, own, aggregate, info):
        """The state for the first compressed step after an FP16 warm-up
        (:mod:`hvd_gradcomp.warmup`): ``own`` (float32 [d], this rank's gradient as decoded)
        and ``aggregate`` (float32 [d], the last all-reduced FP16 step, the same on every
        rank). Scores: the aggregate's squared chunk norms (agreed); EF21: ``h_i = own``,
        ``H = aggregate``; classic error feedback starts from 0, and the ages (``max_age``)
        from 0 as at init (the warm-up does not touch this state)."""
        if not len(state) or self.blocking:
            return state
        m, _, pad = self._sizes(info)
        flat = aggregate if not pad else ops.concat([aggregate, ops.zeros((pad,), "float32", aggregate)], 0)
        norms = ops.norm(ops.reshape(flat, (m, self.config.chunk)), 1)
        scores = ops.where(ops.isfinite(norms), norms * norms, 0.0)
        scores = scores / ops.maximum(ops.max(scores, None), _TINY)
        if self.ef21:
            if self.config.ef21_momentum != 1.0:
                state = state._replace(momentum=own)
            return state._replace(local=own, estimate=aggregate, scores=scores)
        return state._replace(scores=scores)

    def residual_of(self, ops, state, info):
        """Classic error feedback's residual (:func:`~hvd_gradcomp.composite.residual_of`);
        EF21 keeps none (nothing is owed: H is the estimate itself)."""
        return None if self.ef21 else composite.residual_field(self, ops, state, info)

    def metrics(self, state) -> dict:
        """``{"realigned": int64 []}``: steps whose output was 0 because ranks disagreed."""
        return {"realigned": state.realigned} if len(state) else {}

    def payload_dtype(self, info: TensorInfo) -> str:
        return self.config.payload_dtype

    def wire(self, info: TensorInfo) -> WireBytes:
        m, k, _ = self._sizes(info)
        size = itemsize(self.config.payload_dtype)
        if self.blocking:
            return WireBytes(k * self.config.chunk * size, 4 * m, 1)
        return WireBytes((k * self.config.chunk + m + _SLOTS) * size)
