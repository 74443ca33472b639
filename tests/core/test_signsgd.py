"""Single-process tests of signSGD with error feedback (hvd_gradcomp/signsgd.py).

As in tests/core/test_thc.py, several *simulated* ranks of one tensor run in one process
(:class:`Ranks`): each rank compresses with its own state and TensorInfo; the one all-reduce is
the int64 sum of the int32 payloads (``op="sum"``) or Horovod's int32 Average emulated as
``trunc(W * (1.0 / n))`` in float64. Every output, payload and residual is checked against
:class:`RefSignSGD`, a float64 NumPy reference written from the module docstring (the lanes
unpacked with NumPy shifts). Real ranks: tests/parallel/test_signsgd.py.
"""
import numpy as np
import pytest

from hvd_gradcomp.base import EmptyState, TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.registry import make_scheme, parse_spec
from tests.backends import BACKENDS, as_numpy, native_tensor, one_rank_ops
from tests.core.test_thc import emulate_allreduce

CONTROL = 4  # contributes, not finite, scale code, has data


def np_layout(n, op):
    """(lanes, width, guard) of 1-bit lanes from the module docstring: lanes of bit_length(n)
    bits above bit_length(n) guard bits (none under a known Sum), as many as keep the sum of
    n all-ones words below 2**31 (no offset)."""
    width = n.bit_length()
    guard = 0 if op == "sum" else n.bit_length()
    lanes = (32 - guard) // width
    while n * sum(1 << (guard + j * width) for j in range(lanes)) >= 2 ** 31:
        lanes -= 1
    return lanes, width, guard


def split_payload(payload, n, op, d):
    """One rank's own int32 payload -> (bits [d], control [4]) with NumPy shifts."""
    lanes, width, guard = np_layout(n, op)
    words = np.asarray(payload, np.int64)
    m = -(-d // lanes)
    assert words.size == m + CONTROL and (words >= 0).all()
    bits = np.concatenate([(words[:m] >> (guard + j * width)) & ((1 << width) - 1) for j in range(lanes)])[:d]
    return bits, words[m:] >> guard


class RefSignSGD:
    """Every rank of one tensor in float64 (float32 where the scheme rounds: ``p = g + e`` and
    the residual are float32 tensors)."""

    def __init__(self, n, d, error_feedback=True):
        self.n, self.d, self.ef = n, d, error_feedback
        self.residual = [np.zeros(d) for _ in range(n)]

    @staticmethod
    def code(p):
        s = np.abs(p).sum() / p.size
        if not np.isfinite(s) or s <= 1e-30:
            return 0, 0
        return int(np.clip(np.round(4 * np.log2(s)) + 512, 1, 1023)), 1

    def step(self, grads, op):
        ps = [np.float32(g.reshape(-1)) + np.float32(e) if self.ef else np.float32(g.reshape(-1))
              for g, e in zip(grads, self.residual)]
        ps = [p.astype(np.float64) for p in ps]
        codes = [self.code(p) for p in ps]
        have = sum(h for _, h in codes)
        self.scale = 2.0 ** ((sum(c for c, _ in codes) - 512 * have) / max(have, 1) / 4) if have else 0.0
        self.bits = [(p >= 0).astype(np.int64) for p in ps]
        self.codes = codes
        if not all(np.isfinite(np.abs(p).sum()) for p in ps):
            return np.full(self.d, np.nan)
        signs = [2.0 * b - 1.0 for b in self.bits]
        if self.ef:
            self.residual = [np.float32(p - self.scale * s).astype(np.float64) for p, s in zip(ps, signs)]
        out = self.scale * np.sum(signs, axis=0)
        return out / self.n if op != "sum" else out


class Ranks:
    """``n`` simulated ranks of one tensor; ``op``: Horovod's op; ``infer``: TensorInfo.op None."""

    def __init__(self, backend, n, shape, op="average", infer=False, **options):
        self.backend, self.n, self.op, self.shape = backend, n, op, tuple(shape)
        self.ops = one_rank_ops(backend)
        self.scheme = make_scheme("signsgd", **options)
        self.infos = [TensorInfo("layer.w", self.shape, "float32", n, r, None if infer else op) for r in range(n)]
        like = native_tensor(backend, np.zeros(self.shape, np.float32))
        self.states = [self.scheme.init(self.ops, info, like) for info in self.infos]

    def step(self, grads):
        sent = [compress_tensor(self.scheme, self.ops, native_tensor(self.backend, np.float32(g).reshape(self.shape)),
                                self.states[r], self.infos[r]) for r, g in enumerate(grads)]
        self.own = [as_numpy(p) for p, _ in sent]
        assert all(p.dtype == np.int32 for p in self.own)
        reduced = native_tensor(self.backend, emulate_allreduce(self.own, self.op, self.n))
        outs = []
        for r in range(self.n):
            out, self.states[r] = finish_tensor(self.scheme, self.ops, reduced, sent[r][1], self.states[r],
                                                self.infos[r])
            outs.append(as_numpy(out).astype(np.float64).reshape(-1))
        return outs


CASES = [(1, "average", False), (2, "average", False), (2, "sum", False), (3, "average", False),
         (3, "sum", False), (2, "average", True), (3, "sum", True), (8, "average", False)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,op,infer", CASES)
@pytest.mark.parametrize("ef", [True, False])
def test_ranks_match_float64_reference(backend, n, op, infer, ef):
    """Outputs (identical on every rank), each rank's bits and control words, and residuals,
    step by step, against the reference; Average's truncated words are recovered exactly."""
    shape = (7, 13)  # 91 coordinates: the last word's lanes are not all used
    sim, ref = Ranks(backend, n, shape, op, infer, error_feedback=ef), RefSignSGD(n, 91, ef)
    gen = np.random.default_rng([n, int(infer), int(ef)])
    for step in range(4):
        grads = [gen.standard_normal(shape) * gen.uniform(0.1, 3.0) for _ in range(n)]
        outs = sim.step(grads)
        expected = ref.step(grads, op)
        for r in range(n):
            np.testing.assert_array_equal(outs[r], outs[0])
            bits, control = split_payload(sim.own[r], n, None if infer else op, 91)
            np.testing.assert_array_equal(bits, ref.bits[r], err_msg=f"step {step} rank {r} bits")
            assert list(control) == [1, 0, *ref.codes[r]], (step, r)
            if ef:
                np.testing.assert_allclose(as_numpy(sim.states[r].residual), ref.residual[r], rtol=0,
                                           atol=1e-6 * ref.scale, err_msg=f"step {step} rank {r} residual")
            else:
                assert isinstance(sim.states[r], EmptyState)
        assert ref.scale > 0.05
        np.testing.assert_allclose(outs[0], expected, rtol=0, atol=1e-6 * ref.scale * n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_error_feedback_keeps_everything(backend):
    """Under Sum, what was delivered plus what the ranks still owe is all they were given."""
    n, d = 3, 500
    sim = Ranks(backend, n, (d,), "sum")
    gen = np.random.default_rng(5)
    given = delivered = 0.0
    for _ in range(6):
        grads = [gen.standard_normal(d) * np.linspace(0.01, 2, d) for _ in range(n)]
        given = given + np.sum([np.float32(g) for g in grads], axis=0)
        delivered = delivered + sim.step(grads)[0]
    pending = np.sum([as_numpy(st.residual) for st in sim.states], axis=0)
    np.testing.assert_allclose(delivered + pending, given, rtol=0, atol=1e-5 * np.abs(given).max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_on_one_rank(backend):
    """NaN or inf on rank 1: NaN in every coordinate on every rank, rank 1's "not finite" word
    set, every rank's residual as it was; the next finite step matches the reference."""
    n, d = 3, 200
    for op, bad in (("sum", float("nan")), ("average", float("inf")), ("average", -float("inf"))):
        sim, ref = Ranks(backend, n, (d,), op), RefSignSGD(n, d)
        gen = np.random.default_rng(3)
        for _ in range(2):
            grads = [gen.standard_normal(d) for _ in range(n)]
            sim.step(grads), ref.step(grads, op)
        before = [as_numpy(st.residual) for st in sim.states]
        grads = [gen.standard_normal(d) for _ in range(n)]
        grads[1][17] = bad
        outs = sim.step(grads)
        assert all(np.isnan(out).all() for out in outs)
        assert list(split_payload(sim.own[1], n, op, d)[1][:2]) == [1, 1]
        for b, st in zip(before, sim.states):
            np.testing.assert_array_equal(as_numpy(st.residual), b)
        grads = [gen.standard_normal(d) for _ in range(n)]
        outs, expected = sim.step(grads), ref.step(grads, op)
        np.testing.assert_allclose(outs[0], expected, rtol=0, atol=1e-6 * ref.scale * n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zeros_give_zeros(backend):
    """No rank has data: scale 0, output 0, residual 0, codes and flags 0."""
    sim = Ranks(backend, 2, (300,), "average")
    for _ in range(2):
        outs = sim.step([np.zeros(300), np.zeros(300)])
        assert all((out == 0).all() for out in outs)
        assert all((as_numpy(st.residual) == 0).all() for st in sim.states)
        assert all(list(split_payload(p, 2, "average", 300)[1]) == [1, 0, 0, 0]
                   for p in sim.own)


def test_wire_matches_payload_and_bits_per_coordinate():
    """wire() == the payload's bytes; lanes per word as the docstring states them (32/15 bits
    a coordinate under Sum at 2 ranks, 32/14 under Average, 32/6 under Average at 8), and as
    :func:`np_layout` finds them."""
    ops = one_rank_ops(BACKENDS[0])
    scheme = make_scheme("signsgd")
    for n, op, lanes in ((2, "sum", 15), (2, "average", 14), (3, "sum", 15), (3, "average", 14),
                          (8, "average", 6), (1024, "average", 1)):
        assert np_layout(n, op)[0] == lanes == scheme._layout(TensorInfo("w", (1,), "float32", n, 0, op)).lanes
        for d in (1, 15, 16, 1000):
            info = TensorInfo("w", (d,), "float32", n, 0, op)
            x = native_tensor(BACKENDS[0], np.ones(d, np.float32))
            payload, _ = compress_tensor(scheme, ops, x, scheme.init(ops, info, x), info)
            assert scheme.wire(info).payload == as_numpy(payload).nbytes == 4 * (-(-d // lanes) + CONTROL)


def test_config_spec_and_errors():
    assert parse_spec("signsgd:error_feedback=false") == ("signsgd", {"error_feedback": False})
    assert make_scheme("signsgd", error_feedback=False).spec() == "signsgd:error_feedback=false"
    assert not make_scheme("signsgd").scalable
    with pytest.raises(ValueError, match="^signsgd: error_feedback must be"):
        make_scheme("signsgd", error_feedback="maybe")
    ops = one_rank_ops(BACKENDS[0])
    with pytest.raises(ValueError, match="^signsgd: world size must be at most 1024, got 1025$"):
        make_scheme("signsgd").init(ops, TensorInfo("w", (4,), "float32", 1025, 0, "sum"), None)
