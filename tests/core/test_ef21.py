"""TopKC's ``error_feedback="ef21"`` at the scheme level, one process, in each backend.

Several ranks of one tensor are simulated as in tests/core/test_topkc.py
(tests/core/topkc_emulation.py's ``Ranks``: each rank compresses with its own state, the
all-reduce sums the payloads in their dtype, Average scales by 1/n) and checked step by step against the float64 EF21 recursion
(tests/reference.py:RefTopKCEF21); then what the one-all-reduce contract asks of it: a failed
step leaves every state as it was, ranks whose states differ realign, the spec round-trips.
The real multi-rank runs are in tests/parallel/test_warmup.py.
"""
import numpy as np
import pytest

from hvd_gradcomp.base import finish_tensor
from hvd_gradcomp.registry import make_scheme, parse_spec, to_spec
from hvd_gradcomp.topkc import TopKCEF21State
from tests.backends import BACKENDS, as_float64
from tests.core.topkc_emulation import Ranks
from tests.reference import RefTopKCEF21

SHAPE = (7, 13)  # 91 coordinates: the last chunk is padded
EF21 = dict(ratio=0.25, chunk=8, error_feedback="ef21")


def _grads(gen, n, shape=SHAPE):
    # Different scales per chunk and step, so the selection moves between chunks.
    grads = [gen.standard_normal(shape) * gen.uniform(0.1, 3.0, shape).round(1) for _ in range(n)]
    return [g.astype(np.float32).astype(np.float64) for g in grads]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,op", [(1, "average"), (2, "average"), (2, "sum"), (3, "sum"), (3, "average")])
@pytest.mark.parametrize("payload", ["float16", "float32"])
@pytest.mark.parametrize("momentum", [1.0, 0.25])
def test_ef21_matches_float64_recursion(backend, n, op, payload, momentum):
    """Output H, every rank's h_i, the agreed scores, over 8 steps (EF21, and EF21-M with
    ``ef21_momentum``); the output only gets denser."""
    sim = Ranks(backend, n, SHAPE, op, payload_dtype=payload, ef21_momentum=momentum, **EF21)
    ref = RefTopKCEF21(91, n, EF21["ratio"], EF21["chunk"], payload, momentum)
    gen = np.random.default_rng([n, len(op), len(payload)])
    tol = 2e-3 if payload == "float16" else 1e-5
    dense = 0
    for step in range(8):
        grads = _grads(gen, n)
        outs = sim.step(grads)
        expected = ref.step(grads, op)
        scale = np.abs(expected).max()
        for r in range(n):
            np.testing.assert_allclose(outs[r].reshape(-1), expected, rtol=0, atol=tol * scale,
                                       err_msg=f"n={n} {op} {payload} step {step} rank {r} output")
            np.testing.assert_array_equal(outs[r], outs[0])
            state = sim.states[r]
            assert isinstance(state, TopKCEF21State)
            np.testing.assert_allclose(as_float64(state.local), ref.h[r], rtol=0,
                                       atol=tol * max(np.abs(ref.h[r]).max(), 1), err_msg=f"step {step} h_{r}")
            np.testing.assert_array_equal(as_float64(state.estimate), as_float64(sim.states[0].estimate))
            np.testing.assert_allclose(as_float64(state.scores), ref.prev, rtol=tol, atol=tol)
            if momentum != 1.0:
                np.testing.assert_allclose(as_float64(state.momentum), ref.v[r], rtol=1e-6, atol=1e-6)
            else:
                assert as_float64(state.momentum).size == 0
            assert int(state.step) == step + 1 and int(state.realigned) == 0
        # H keeps every coordinate it was ever sent: the output only gets denser.
        assert np.count_nonzero(outs[0]) >= dense, f"step {step}: output lost coordinates"
        dense = np.count_nonzero(outs[0])
    # H is the sum (Sum) or the mean (Average) of the ranks' h_i, up to the rounding of the
    # all-reduce's own additions (fp16 sums round once per addition).
    total = sum(ref.h) / (n if op == "average" else 1)
    np.testing.assert_allclose(ref.H, total, rtol=0, atol=tol * np.abs(total).max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_ef21_repeated_gradient_converges(backend):
    """A gradient that stops changing is delivered exactly once h_i has caught up (EF21's
    fixed point): after 1/ratio steps the output is the all-reduced gradient, every step."""
    n = 2
    sim = Ranks(backend, n, SHAPE, "average", payload_dtype="float32", **EF21)
    grads = _grads(np.random.default_rng(5), n)
    target = sum(grads) / n
    for step in range(10):
        outs = sim.step(grads)
    np.testing.assert_allclose(outs[0], target, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ef21_nonfinite_step_keeps_state(backend):
    """A NaN on one rank: every rank's output is NaN, every state exactly as before."""
    n = 2
    sim = Ranks(backend, n, SHAPE, "sum", **EF21)
    gen = np.random.default_rng(3)
    for _ in range(3):
        sim.step(_grads(gen, n))
    before = [[as_float64(v) for v in s] for s in sim.states]
    grads = _grads(gen, n)
    grads[1][2, 3] = np.nan
    outs = sim.step(grads)
    for r in range(n):
        assert np.isnan(outs[r]).any()
        for a, b in zip(before[r], sim.states[r]):
            np.testing.assert_array_equal(a, as_float64(b))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["sum", "average"])
def test_ef21_states_that_differ_realign(backend, op):
    """Rank 1 missed two steps (as after hvd.join()): the vote carries the step counter, so
    the ranks disagree even where their selections coincide; the output is 0 on every rank,
    every rank restarts h_i, H and the step at 0 and from then on matches a fresh recursion."""
    n = 2
    sim = Ranks(backend, n, SHAPE, op, payload_dtype="float32", **EF21)
    gen = np.random.default_rng(11)
    for _ in range(4):
        sim.step(_grads(gen, n))
    lagging = sim.states[1]
    for _ in range(2):
        sim.step(_grads(gen, n))
    sim.states[1] = lagging._replace(scores=sim.states[0].scores)  # same selection, older step
    outs = sim.step(_grads(gen, n))
    for r in range(n):
        assert not outs[r].any(), "a disagreement must give 0, never a wrong sum"
        s = sim.states[r]
        assert int(s.realigned) == 1 and int(s.step) == 0
        assert not as_float64(s.local).any() and not as_float64(s.estimate).any()
    np.testing.assert_array_equal(as_float64(sim.states[0].scores), as_float64(sim.states[1].scores))
    ref = RefTopKCEF21(91, n, EF21["ratio"], EF21["chunk"], "float32")
    ref.prev = as_float64(sim.states[0].scores)
    for step in range(4):
        grads = _grads(gen, n)
        outs = sim.step(grads)
        expected = ref.step(grads, op)
        for r in range(n):
            np.testing.assert_allclose(outs[r].reshape(-1), expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_ef21_spec_and_options():
    """``error_feedback`` takes true, false or ef21; canonical specs stay as they were."""
    assert parse_spec("topkc:0.1,error_feedback=EF21") == ("topkc", {"ratio": 0.1, "error_feedback": "ef21"})
    assert to_spec(make_scheme("topkc", 0.1, error_feedback="ef21")) == "topkc:ratio=0.1,error_feedback=ef21"
    assert to_spec(make_scheme("topkc", 0.1, error_feedback=False)) == "topkc:ratio=0.1,error_feedback=false"
    assert to_spec(make_scheme("topkc", 0.1)) == "topkc:ratio=0.1"
    with pytest.raises(ValueError, match=r"^topkc: error_feedback must be True, False or 'ef21', got 'ef22'$"):
        make_scheme("topkc", error_feedback="ef22")
    with pytest.raises(ValueError, match=r"^topkc: error_feedback must be true, false or ef21, got 'maybe'$"):
        parse_spec("topkc:error_feedback=maybe")
    with pytest.raises(ValueError, match="needs error_feedback=True"):
        make_scheme("topkc", error_feedback="ef21", residual_decay=0.9)
    with pytest.raises(ValueError, match="ef21_momentum=0.5 needs error_feedback='ef21'"):
        make_scheme("topkc", ef21_momentum=0.5)
    with pytest.raises(ValueError, match="needs selection='previous'"):
        make_scheme("topkc", error_feedback="ef21", selection="current")
    with pytest.raises(ValueError, match=r"^thc: error_feedback must be True or False, got 'ef21'$"):
        make_scheme("thc", error_feedback="ef21")
    scheme = make_scheme("topkc", error_feedback="ef21")
    assert {"local", "estimate"} <= set(scheme.rank_local_fields)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["sum", "average"])
def test_powersgd_ef21_recursion(backend, op):
    """PowerSGD alternating with EF21, 2 ranks, 8 steps, against the float64 recursion on the
    agreed basis each step starts from (even: P_i = (G_i - h_i) Q^, odd: Q_i = (G_i - h_i)^T P^;
    h_i += its own decoded factor, H += the decoded aggregate; output H), whose basis tracking
    is PowerSGD's own (tests/core/test_powersgd.py)."""
    from tests.core.test_warmup import Sim
    n, shape = 2, (8, 12)
    sim = Sim(backend, n, op, "powersgd:2,error_feedback=ef21", shape=shape)
    gen = np.random.default_rng(7)
    h = [np.zeros(shape) for _ in range(n)]
    H = np.zeros(shape)
    for step in range(8):
        st = sim.states[0]
        p, q, even = as_float64(st.p).T, as_float64(st.q).T, int(st.step) % 2 == 0
        grads = [gen.standard_normal(shape) for _ in range(n)]
        grads = [g.astype(np.float32).astype(np.float64) for g in grads]
        outs = sim.step(grads)
        own = [(g - hi) @ q @ q.T if even else p @ p.T @ (g - hi) for g, hi in zip(grads, h)]
        total = sum(own) / (n if op == "average" else 1)
        H = H + total
        h = [hi + o for hi, o in zip(h, own)]
        for r in range(n):
            np.testing.assert_allclose(outs[r], H, rtol=0, atol=1e-4 * np.abs(H).max(), err_msg=f"step {step} rank {r}")
            np.testing.assert_allclose(as_float64(sim.states[r].local), h[r], rtol=0, atol=1e-4 * np.abs(h[r]).max())
            np.testing.assert_array_equal(as_float64(sim.states[r].estimate), as_float64(sim.states[0].estimate))
        assert int(sim.states[0].realigned) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_powersgd_ef21_realigns_and_options(backend):
    """A rank whose state is two steps behind: output 0 on both, h_i and H restart at 0; the
    two-round variant refuses EF21 with the reason."""
    from tests.core.test_warmup import Sim
    n, shape = 2, (8, 12)
    sim = Sim(backend, n, "sum", "powersgd:2,error_feedback=ef21", shape=shape)
    gen = np.random.default_rng(8)
    for step in range(5):
        if step == 3:
            old = sim.states[1]
        sim.step([gen.standard_normal(shape) for _ in range(n)])
    sim.states[1] = old
    outs = sim.step([gen.standard_normal(shape) for _ in range(n)])
    for r in range(n):
        assert not outs[r].any()
        assert int(sim.states[r].realigned) == 1 and not as_float64(sim.states[r].estimate).any()
        assert not as_float64(sim.states[r].local).any()
    outs = sim.step([gen.standard_normal(shape) for _ in range(n)])
    np.testing.assert_array_equal(outs[0], outs[1])
    assert outs[0].any()
    with pytest.raises(ValueError, match="needs variant='alternating'"):
        make_scheme("powersgd", error_feedback="ef21", variant="two_round")
    assert to_spec(make_scheme("powersgd", 4, error_feedback="ef21")) == "powersgd:rank=4,error_feedback=ef21"
