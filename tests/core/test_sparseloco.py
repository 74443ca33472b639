"""Single-process tests of SparseLoCo on an all-reduce (hvd_gradcomp/sparseloco.py).

Several *simulated* ranks of one tensor run in one process, each with its own state and
TensorInfo; the one all-reduce is the int64 sum of the int32 payloads (wrapping modulo 2**32
as int32 does, for ``subtract_own``) or Horovod's int32 Average, ``trunc(W / n)``
(:func:`tests.core.thc_emulation.emulate_allreduce`). Each rank's own payload is unpacked
with NumPy shifts, independently of ``hvd_gradcomp.lanes``. Real ranks:
tests/parallel/test_sparseloco.py.
"""
import numpy as np
import pytest

from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.registry import make_scheme, parse_spec, to_spec
from hvd_gradcomp.sparseloco import SparseLoCoState
from tests.backends import as_numpy, one_rank_ops
from tests.core.thc_emulation import emulate_allreduce

_np = as_numpy
GRID = 1.0 + 2.0 ** -20


def _tensor(v):
    import torch
    return torch.tensor(np.asarray(v, np.float32))


class Ranks:
    """``n`` simulated ranks of one tensor of ``d`` coordinates."""

    def __init__(self, n, d, op="sum", told=True, **options):
        import torch
        self.ops = one_rank_ops("torch")
        self.scheme = make_scheme("sparseloco", **options)
        self.n, self.d, self.op = n, d, op
        # told=False: the scheme is not told the op (a call made by hand)
        self.infos = [TensorInfo("layer.weight", (d,), "float32", n, r, op if told else None) for r in range(n)]
        self.states = [self.scheme.init(self.ops, i, torch.zeros(1)) for i in self.infos]
        self.lay = self.scheme.layout(self.infos[0])

    def step(self, xs, joined=()):
        """One step: ``xs`` [n][d]; ranks in ``joined`` contribute zeros. Returns (outs,
        payloads, ctxs, old states)."""
        import torch
        own = self.lay.levels.others
        comp = {r: compress_tensor(self.scheme, self.ops, _tensor(xs[r]), self.states[r], self.infos[r])
                for r in range(self.n) if r not in joined}
        payloads = {r: _np(p).copy() for r, (p, _) in comp.items()}
        total = emulate_allreduce(list(payloads.values()), self.op, self.n, wrap=own)
        old, outs = list(self.states), {}
        for r, (_, ctx) in comp.items():
            out, self.states[r] = finish_tensor(self.scheme, self.ops, torch.tensor(total), ctx, self.states[r],
                                                self.infos[r])
            outs[r] = _np(out)
        return outs, payloads, {r: c for r, (_, c) in comp.items()}, old


def np_levels(words, lay, count):
    """One rank's levels from its own int32 level words, with NumPy shifts."""
    w = np.asarray(words, np.int64)
    if lay.offset:
        w = w + lay.offset
    w = w & 0xFFFFFFFF
    lanes = [(w >> (lay.guard + j * lay.width)) & ((1 << lay.width) - 1) for j in range(lay.lanes)]
    return np.concatenate(lanes)[:count]


def own_decoded(ranks, payload, codes, idx):
    """float64 [k, C]: one rank's decoded chunks from its own payload and the agreed codes."""
    lay, C = ranks.lay, ranks.scheme.config.chunk
    top = lay.levels.top
    q = np_levels(payload[:lay.level_words], lay.levels, lay.selected * C).reshape(-1, C)
    c = codes[idx].astype(np.float32)
    R = np.where(c > 0.5, np.exp2((c - 256.0) / 4.0) * np.float32(lay.threshold), 0.0)
    delta = R * 2.0 * GRID / top
    return (q - 0.5 * top / GRID) * delta[:, None], q


@pytest.mark.parametrize("n,op,own,bits,spread", [(2, "sum", True, 2, False), (2, "average", True, 2, True),
                                                  (3, "sum", True, 3, False), (4, "average", False, 2, False),
                                                  (2, "sum", False, 4, True), (5, None, True, 2, False)])
def test_integer_sum_is_the_sum_of_each_ranks_decoded_chunks(n, op, own, bits, spread):
    """The all-reduced lanes hold exactly the sum of every rank's levels, and the output is
    the sum (or mean) of each rank's decoded chunks: bit for bit against the float32 formula
    from those exact integers, to float64 rounding against the per-rank sum."""
    d, gen = 3000, np.random.default_rng(1)
    # op None: Sum, but the scheme is not told (it infers it from the count word)
    ranks = Ranks(n, d, op or "sum", op is not None, ratio=0.1, chunk=32, bits=bits, subtract_own=own,
                  interleave=spread)
    C = 32
    for step in range(4):
        codes = _np(ranks.states[0].codes)
        xs = [gen.standard_normal(d).astype(np.float32) * (1 + r) for r in range(n)]
        outs, payloads, ctxs, _ = ranks.step(xs)
        idx = _np(ctxs[0].idx)
        decoded = [own_decoded(ranks, payloads[r], codes, idx) for r in range(n)]
        S = sum(q for _, q in decoded)
        assert S.max() <= n * ranks.lay.levels.top and S.min() >= 0
        for r in range(n):  # the selection is agreed
            np.testing.assert_array_equal(_np(ctxs[r].idx), idx)
            np.testing.assert_array_equal(outs[r], outs[0])
        # The float32 formula on the exact integer sums, bit for bit.
        top = ranks.lay.levels.top
        delta = _np(ctxs[0].delta).astype(np.float32)
        div = np.float32(1.0 if (op or "sum") == "sum" else 1.0 / n)
        rows = (S.astype(np.float32) - np.float32(n) * np.float32(0.5 * top / GRID)) * (delta * div)
        np.testing.assert_array_equal(outs[0], _scatter(rows, idx, ranks, d).astype(np.float32))
        # ... and the sum of each rank's decoded chunks.
        mean = sum(v for v, _ in decoded) * float(div)
        np.testing.assert_allclose(outs[0].reshape(-1)[:d], _scatter(mean, idx, ranks, d), rtol=1e-6, atol=1e-6)
        if step:
            assert np.abs(outs[0]).sum() > 0  # from the second step on, chunks carry values


def _scatter(rows, idx, ranks, d):
    """float64 [d]: chunk rows in the tensor's order (``interleave``: chunk j, position i is
    coordinate i m + j)."""
    full = np.zeros((ranks.lay.chunks, ranks.scheme.config.chunk))
    full[idx] = rows
    if ranks.scheme.config.interleave:
        full = full.T
    return full.reshape(-1)[:d]


@pytest.mark.parametrize("decay,spread", [(0.95, False), (1.0, False), (0.0, False), (0.95, True)])
def test_error_feedback_balance(decay, spread):
    """sent + kept = decay e + x on every rank and step; over the run, what every rank sent
    plus what it keeps equals its decay-accumulated input."""
    n, d, gen = 2, 2000, np.random.default_rng(2)
    ranks = Ranks(n, d, ratio=0.2, chunk=16, decay=decay, interleave=spread)
    acc = [np.zeros(d) for _ in range(n)]
    sent_total = [np.zeros(d) for _ in range(n)]
    for _ in range(6):
        xs = [gen.standard_normal(d).astype(np.float32) for _ in range(n)]
        _, payloads, ctxs, old = ranks.step(xs)
        for r in range(n):
            idx = _np(ctxs[r].idx)
            vals, _ = own_decoded(ranks, payloads[r], _np(old[r].codes), idx)
            sent = _scatter(vals, idx, ranks, d)
            kept = _np(ranks.states[r].residual).astype(np.float64)
            np.testing.assert_allclose(sent + kept, decay * _np(old[r].residual) + xs[r], rtol=1e-5, atol=1e-5)
            acc[r] = decay * acc[r] + xs[r]
            sent_total[r] = decay * sent_total[r] + sent
            np.testing.assert_allclose(sent_total[r] + kept, acc[r], rtol=1e-4, atol=1e-4)


def test_agreed_codes_rank_and_scale_the_next_chunks():
    """The codes after a step are the same on every rank, the mean of the ranks' codes of the
    RMS of b e' + x; the next selection is their top k (ties by lower index)."""
    n, d, gen = 3, 4096, np.random.default_rng(3)
    ranks = Ranks(n, d, ratio=0.05, chunk=64, interleave=False)
    xs = [gen.standard_normal(d).astype(np.float32) * np.repeat(gen.uniform(0.1, 5, 64), 64) for _ in range(n)]
    _, _, ctxs, _ = ranks.step(xs)
    guess = []
    for r in range(n):
        g = 0.95 * _np(ranks.states[r].residual).astype(np.float64) + xs[r]
        rms = np.sqrt((g.reshape(64, 64) ** 2).mean(1))
        guess.append(np.clip(np.round(4 * np.log2(rms)) + 256, 1, 511))
    want = np.mean(guess, 0)
    for r in range(n):
        np.testing.assert_allclose(_np(ranks.states[r].codes), want, rtol=1e-6)
    np.testing.assert_array_equal(_np(ranks.states[1].codes), _np(ranks.states[0].codes))
    _, _, ctxs, _ = ranks.step(xs)
    k = ranks.lay.selected
    np.testing.assert_array_equal(_np(ctxs[0].idx), np.argsort(-want, kind="stable")[:k])


def test_disagreement_gives_zero_and_realigns():
    """A rank whose state is not the others' (a checkpoint loaded on one rank only): output 0
    on every rank, every rank keeps all of c, and the ranks agree again from the next step."""
    n, d, gen = 2, 2048, np.random.default_rng(4)
    ranks = Ranks(n, d, ratio=0.1, chunk=32)
    for _ in range(2):
        ranks.step([gen.standard_normal(d).astype(np.float32) for _ in range(n)])
    s = ranks.states[1]
    ranks.states[1] = s._replace(codes=s.codes.flip(0))
    xs = [gen.standard_normal(d).astype(np.float32) for _ in range(n)]
    outs, _, _, old = ranks.step(xs)
    for r in range(n):
        assert not outs[r].any()
        np.testing.assert_allclose(_np(ranks.states[r].residual), 0.95 * _np(old[r].residual) + xs[r], rtol=1e-6,
                                   atol=1e-6)
        assert int(_np(ranks.states[r].realigned)) == 1 and int(_np(ranks.states[r].step)) == 0
    np.testing.assert_array_equal(_np(ranks.states[0].codes), _np(ranks.states[1].codes))
    outs, _, _, _ = ranks.step(xs)
    assert np.abs(outs[0]).sum() > 0 and all(int(_np(s.realigned)) == 1 for s in ranks.states)


def test_nonfinite_rank_poisons_every_output_and_keeps_state():
    n, d, gen = 2, 2048, np.random.default_rng(5)
    ranks = Ranks(n, d, ratio=0.1)
    ranks.step([gen.standard_normal(d).astype(np.float32) for _ in range(n)])
    xs = [gen.standard_normal(d).astype(np.float32) for _ in range(n)]
    xs[1][7] = np.nan
    outs, _, _, old = ranks.step(xs)
    for r in range(n):  # NaN on every rank (on the agreed chunks), so a loss scaler skips the step
        assert np.isnan(outs[r]).any() and np.array_equal(np.isnan(outs[r]), np.isnan(outs[0]))
        for a, b in zip(old[r], ranks.states[r]):
            np.testing.assert_array_equal(_np(a), _np(b))


def test_joined_rank_contributes_nothing():
    """A rank in hvd.join() adds zeros: the others' sum, on their agreed chunks."""
    n, d, gen = 3, 2048, np.random.default_rng(6)
    ranks = Ranks(n, d, ratio=0.1, chunk=32)
    for _ in range(2):
        xs = [gen.standard_normal(d).astype(np.float32) for _ in range(n)]
        codes = _np(ranks.states[0].codes)
        outs, payloads, ctxs, _ = ranks.step(xs, joined=(2,))
        idx = _np(ctxs[0].idx)
        want = sum(own_decoded(ranks, payloads[r], codes, idx)[0] for r in (0, 1))
        np.testing.assert_allclose(outs[0], _scatter(want, idx, ranks, d), rtol=1e-6, atol=1e-6)


def test_state_round_trip_resumes_exactly():
    """The state is a NamedTuple of tensors: saved with torch.save and loaded into fresh
    ranks, the run goes on bit for bit as the uninterrupted one."""
    import io
    import torch
    n, d, gen = 2, 3000, np.random.default_rng(7)
    xs = [[gen.standard_normal(d).astype(np.float32) for _ in range(n)] for _ in range(6)]
    a = Ranks(n, d, ratio=0.1)
    for step in xs[:3]:
        a.step(step)
    buf = io.BytesIO()
    torch.save([s._asdict() for s in a.states], buf)
    buf.seek(0)
    b = Ranks(n, d, ratio=0.1)
    b.states = [SparseLoCoState(**s) for s in torch.load(buf)]
    for step in xs[3:]:
        oa, _, _, _ = a.step(step)
        ob, _, _, _ = b.step(step)
        np.testing.assert_array_equal(oa[0], ob[0])
    for sa, sb in zip(a.states, b.states):
        for u, v in zip(sa, sb):
            np.testing.assert_array_equal(_np(u), _np(v))


def test_wire_and_spec():
    """Bytes per step from the layout (2 ranks, Sum, subtract_own: 2-bit values 16 a word, 3
    codes and 15 flags a word), and the spec round trip."""
    spec = "sparseloco:ratio=0.03,chunk=64,bits=2,decay=0.95"
    scheme = make_scheme(*parse_spec(spec)[:1], **parse_spec(spec)[1])
    info = TensorInfo("w", (1 << 20,), "float32", 2, 0, "sum")
    m = (1 << 20) // 64
    k = int(np.ceil(0.03 * m))
    assert scheme.wire(info).payload == 4 * (-(-k * 64 // 16) + -(-m // 3) + -(-m // 15) + 4)
    assert 16 * (1 << 20) / (8 * scheme.wire(info).payload) > 60  # bits vs fp16, per step
    default = make_scheme("sparseloco")  # ratio 0.06, chunk 128: about 73x fewer than fp16
    assert 16 * (1 << 20) / (8 * default.wire(info).payload) > 70
    name, options = parse_spec(to_spec(scheme))[:2]  # the canonical spec gives the same config back
    assert name == "sparseloco" and make_scheme(name, **options).config == scheme.config
    with pytest.raises(ValueError, match="sparseloco: bits must be"):
        make_scheme("sparseloco", bits=9)
    with pytest.raises(ValueError, match="sparseloco: decay must be"):
        make_scheme("sparseloco", decay=1.5)


@pytest.mark.parametrize("spread", [True, False])
def test_hand_over_after_fp16_warmup_sets_agreed_codes(spread):
    """After an FP16 warm-up the codes come from the all-reduced FP16 step (one rank's scale:
    a Sum divided by n), the same on every rank, so the first compressed step sends; without
    them it would send nothing."""
    import torch
    from hvd_gradcomp import composite
    n, d, gen = 2, 3000, np.random.default_rng(8)
    ranks = Ranks(n, d, ratio=0.1, chunk=32, interleave=spread)
    agg = gen.standard_normal(d).astype(np.float32) * np.repeat(gen.uniform(0.5, 4, 30), 100).astype(np.float32)
    for r in range(n):
        ranks.states[r] = composite.hand_over(ranks.scheme, ranks.ops, ranks.states[r], torch.zeros(d),
                                              torch.tensor(agg), ranks.infos[r])
    full = np.zeros(ranks.lay.chunks * 32)
    full[:d] = agg.astype(np.float64) / n
    rows = full.reshape(32, -1).T if spread else full.reshape(-1, 32)
    want = np.clip(np.round(4 * np.log2(np.sqrt((rows ** 2).mean(1)))) + 256, 1, 511)
    for r in range(n):
        np.testing.assert_array_equal(_np(ranks.states[r].codes), want.astype(np.float32))
    outs, _, ctxs, _ = ranks.step([gen.standard_normal(d).astype(np.float32) for _ in range(n)])
    np.testing.assert_array_equal(_np(ctxs[0].idx), np.argsort(-want, kind="stable")[:ranks.lay.selected])
    assert np.count_nonzero(outs[0]) > 0.5 * ranks.lay.selected * 32


def test_fp16_warmup_composes():
    """``fp16_warmup=1``: an FP16 step, then the compressed steps from the handed-over codes."""
    import torch
    from tests.backends import scheme_steps
    ops = one_rank_ops("torch")
    gen = np.random.default_rng(9)
    xs = [torch.tensor(gen.standard_normal(4096).astype(np.float32)) for _ in range(3)]
    log = scheme_steps(ops, make_scheme("sparseloco", fp16_warmup=1), xs,
                       TensorInfo("w", (4096,), "float32", 1, 0, "sum"))
    assert _np(log[0]["payload"]).dtype == np.float16 and _np(log[1]["payload"]).dtype == np.int32
    assert np.count_nonzero(_np(log[1]["out"])) > 0  # without the hand-over, step 2 sends nothing
