"""THC (hvd_gradcomp/thc.py) across simulated ranks (tests/core/thc_emulation.py) when something
goes wrong: a non-finite gradient or an overflowing rotation on one rank (NaN everywhere, every
state kept), a fingerprint mismatch or a rank one step behind (output 0, realigned), a joined
rank (contributes nothing); each next step correct again, against the float64 reference.

The protocol when all goes well: tests/core/test_thc.py; with real ranks: tests/parallel/test_thc.py.
"""
import numpy as np
import pytest

from hvd_gradcomp.thc import THCConfig
from tests.backends import BACKENDS, as_numpy as _np
from tests.core.thc_emulation import Ranks, emulate_allreduce, fails_cleanly_on_rank_1, fingerprint_ok, split_payload

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("range_", ["previous", "current"])
def test_nonfinite_on_one_rank(backend, range_):
    """NaN or inf on one rank: NaN in every coordinate of every rank's output, and every
    rank's whole state (residual, ranges, step, counters) stays as it was; the next finite
    step is correct again."""
    n = 3
    cases = (("sum", float("nan")), ("average", float("inf")), ("sum", -float("inf")))
    for op, bad in cases if backend == "torch" else cases[1:2]:  # TF: the same code, slower
        sim = Ranks(backend, n, (3000,), THCConfig(range=range_), op=op)
        gen = np.random.default_rng(11)
        for _ in range(2):  # a non-trivial state: residual, ranges and step set
            sim.step([gen.standard_normal(3000) for _ in range(n)])
        xs = [gen.standard_normal(3000) for _ in range(n)]
        xs[1][17] = bad
        log = fails_cleanly_on_rank_1(sim, xs, gen)
        assert all(int(st.step) == 3 for st in log["after"])


@pytest.mark.parametrize("backend,op", [(b, op) for b in BACKENDS for op in ("sum", "average")
                                        if b == "torch" or op == "average"])
def test_fingerprint_mismatch_realigns(backend, op):
    """One rank's state has another step (a checkpoint loaded on it alone): the output is
    exactly 0 on every rank, realigned counts 1, the residual keeps all of y, the counters
    restart at 0 everywhere, and the next step is correct again."""
    n = 3
    sim = Ranks(backend, n, (3000,), THCConfig(), op=op)
    gen = np.random.default_rng(4)
    for _ in range(3):
        sim.step([gen.standard_normal(3000) for _ in range(n)])
    sim.states[1] = sim.states[1]._replace(step=sim.states[1].step + 5)
    log = sim.step([gen.standard_normal(3000) for _ in range(n)])
    assert not fingerprint_ok(list(log["own"].values()), sim.lay)
    for r, (out, st) in enumerate(zip(log["outs"], log["after"])):
        assert (out == 0).all()
        assert int(st.realigned) == 1 and int(st.step) == 0
        np.testing.assert_array_equal(_np(st.residual), _np(log["ctxs"][r].corrected))
        np.testing.assert_array_equal(_np(st.ranges), _np(log["after"][0].ranges))
        assert int(sim.scheme.metrics(st)["realigned"]) == 1
    for t in range(2):
        log = sim.step([gen.standard_normal(3000) for _ in range(n)])
        assert fingerprint_ok(list(log["own"].values()), sim.lay)
        ref = sim.check_reference(log)
        assert np.abs(ref).max() > 0.5
        for st in log["after"]:
            assert int(st.realigned) == 1 and int(st.step) == t + 1


@pytest.mark.parametrize("op", ["sum", "average"])
def test_one_step_lag_is_always_detected(op):
    """A rank one step behind (back from one step in hvd.join(), say) disagrees on the step's
    fingerprint at every step, also where a 13-bit hash of the step collided with the next
    one's (step 2074 did): output 0 on every rank, realigned counted, never a wrong value."""
    n = 3
    gen = np.random.default_rng(8)
    for base in (0, 1, 2074, 4095, 8191, 8192, 10 ** 6 + 3):
        sim = Ranks("torch", n, (3000,), THCConfig(), op=op)
        sim.step([gen.standard_normal(3000) for _ in range(n)])
        sim.states = [st._replace(step=st.step * 0 + base + (1 if r == 2 else 0)) for r, st in enumerate(sim.states)]
        log = sim.step([gen.standard_normal(3000) for _ in range(n)])
        assert not fingerprint_ok(list(log["own"].values()), sim.lay), base
        assert all((out == 0).all() for out in log["outs"]), base
        assert [int(st.realigned) for st in log["after"]] == [1, 1, 1], base


@pytest.mark.parametrize("backend", BACKENDS)
def test_rotation_overflow_counts_as_not_finite(backend):
    """Finite values whose sum is finite but whose rotation overflows float32 ([3e38, -3e38]:
    sum 0, rotated 4.2e38): treated as a non-finite gradient, NaN on every rank, every state
    kept (the residual never holds an inf), and the next step is correct."""
    n = 3
    sim = Ranks(backend, n, (3000,), THCConfig(), op="average")
    gen = np.random.default_rng(12)
    for _ in range(2):
        sim.step([gen.standard_normal(3000) for _ in range(n)])
    xs = [gen.standard_normal(3000) for _ in range(n)]
    xs[1][:2] = [3e38, -3e38]
    fails_cleanly_on_rank_1(sim, xs, gen)


@pytest.mark.parametrize("op", ["sum", "average"])
def test_joined_rank_contributes_nothing(op):
    """A rank in hvd.join() adds zeros: c counts the contributors, the output is their sum
    (divided by the whole n under Average, Horovod's convention), and the joined rank's state
    stays. When it comes back its step lags: one realigned step (output 0), then correct."""
    n = 3
    sim = Ranks("torch", n, (3000,), THCConfig(bits=8), op=op)
    gen = np.random.default_rng(5)
    sim.step([gen.standard_normal(3000) for _ in range(n)])
    for _ in range(2):
        log = sim.step([gen.standard_normal(3000) for _ in range(n)], contribute=[True, True, False])
        ref = sim.check_reference(log)
        assert np.abs(ref).max() > 0.5 and log["outs"][2] is None
        control = split_payload(emulate_allreduce(list(log["own"].values()), "sum", n), sim.lay, n)[3]
        assert int(control[0]) == 2
    assert [int(st.step) for st in sim.states] == [3, 3, 1]
    log = sim.step([gen.standard_normal(3000) for _ in range(n)])
    assert all((out == 0).all() for out in log["outs"])
    assert [int(st.realigned) for st in log["after"]] == [1, 1, 1]
    log = sim.step([gen.standard_normal(3000) for _ in range(n)])
    assert np.abs(sim.check_reference(log)).max() > 0.5
