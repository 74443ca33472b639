"""PowerSGD batched (hvd_gradcomp/powersgd_batched.py): a bucket's matrices of one view sent as one
batch equal per-matrix PowerSGD within float32 rounding, take as many operations for 8 matrices
as for 2, and resume from per-matrix and batched checkpoints. Over the N-rank engine
(torch_backend/simulated.py), 2 ranks with different gradients."""
import pytest

torch = pytest.importorskip("torch")

from hvd_gradcomp.buckets import Member  # noqa: E402
from hvd_gradcomp.orthogonalize import basis_rows, basis_rows_batched  # noqa: E402
from hvd_gradcomp.powersgd_batched import BatchedPowerSGD  # noqa: E402
from torch_backend.ops import REFERENCE_OPS  # noqa: E402
from torch_backend.simulated import SimulatedEngine  # noqa: E402
from tests.backends import BACKENDS  # noqa: E402

# Three matrices of one view, two conv kernels of another (16 x 36), a vector (fp16) and a
# matrix alone in its view (per matrix).
SHAPES = (("a1", (32, 48)), ("bias", (32,)), ("a2", (32, 48)), ("c1", (16, 4, 3, 3)), ("a3", (32, 48)),
          ("odd", (24, 40)), ("c2", (16, 4, 3, 3)))
SPEC = "powersgd:2"
RANKS = 2


def _members(shapes=SHAPES):
    out, offset = [], 0
    for key, shape in shapes:
        numel = 1
        for s in shape:
            numel *= s
        out.append(Member(key, f"layer.{key}", shape, offset, numel))
        offset += numel
    return tuple(out)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _gradients(members, steps, seed=3):
    g = torch.Generator().manual_seed(seed)
    total = sum(m.numel for m in members)
    return [[torch.randn(total, generator=g) for _ in range(RANKS)] for _ in range(steps)]


def _batched_step(engine, comps, bufs, members):
    return engine.allreduce_bucket(comps, bufs, members)


def _per_matrix_step(engine, comps, bufs, members):
    """Each member as its own bucket: today's per-matrix PowerSGD."""
    outs = [torch.zeros_like(b) for b in bufs]
    for m in members:
        one = (Member(m.key, m.label, m.shape, 0, m.numel),)
        got = engine.allreduce_bucket(comps, [b[m.offset:m.offset + m.numel].clone() for b in bufs], one)
        for r in range(RANKS):
            outs[r][m.offset:m.offset + m.numel] = got[r]
    return outs


def _close(a, b, what):
    scale = max(b.abs().max().item(), 1e-6)
    gap = (a - b).abs().max().item() / scale
    assert gap < 2e-4, f"{what}: batched and per-matrix differ by {gap:.3g} (relative to the largest value)"


def _run(step, steps, members, comps=None, engine=None, grads=None):
    engine = engine or SimulatedEngine(RANKS)
    comps = comps or engine.compressors(SPEC)
    outs = [step(engine, comps, bufs, members) for bufs in grads[:steps]]
    return engine, comps, outs


def test_batched_equals_per_matrix():
    """Six steps (both factors travel three times each): every rank's output equals per-matrix
    PowerSGD's within float32 rounding, and so does each member's error feedback; the bucket is
    one batch unit per view (a1-a3, c1-c2), the odd matrix and the vector alone."""
    members = _members()
    grads = _gradients(members, 6)
    _, batched, outs = _run(_batched_step, 6, members, grads=grads)
    _, ref, refs = _run(_per_matrix_step, 6, members, grads=grads)
    for t, (o, r) in enumerate(zip(outs, refs)):
        for rank in range(RANKS):
            _close(o[rank], r[rank], f"step {t} rank {rank}")
    for m in members:
        if m.key != "bias":
            for rank in range(RANKS):
                _close(batched[rank].error_feedback(m.key), ref[rank].error_feedback(m.key), f"error feedback of {m.key}")
    plan = batched[0].codec.plan_bucket(members, "float32", "sum", None, grads[0][0])
    batches = sorted(tuple(members[i].key for i in u.members) for u in plan.units if isinstance(u.scheme, BatchedPowerSGD))
    assert batches == [("a1", "a2", "a3"), ("c1", "c2")], batches
    assert len(plan.units) == 4  # the two batches, odd, bias


def _batches(comp, members, like):
    """The batch units' member keys of ``comp``'s plan of a bucket of ``members``."""
    plan = comp.codec.plan_bucket(members, "float32", "sum", None, like)
    return sorted(tuple(members[i].key for i in u.members) for u in plan.units if isinstance(u.scheme, BatchedPowerSGD))


def _count_ops(fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return Count.n


@pytest.mark.parametrize("both_parities", [False, True])
def test_operations_do_not_grow_with_the_matrices(both_parities):
    """One bucket of 2 matrices and one of 8 of the same view: a step (encode, reduce, decode)
    dispatches as many operations (counted after two warm steps, so both factors' steps run)."""
    counts = []
    for b in (2, 8):
        members = _members(tuple((f"m{i}", (32, 48)) for i in range(b)))
        engine = SimulatedEngine(1)
        comp, = engine.compressors(SPEC)
        bufs = [[g[0]] for g in _gradients(members, 4)]
        for bufs_t in bufs[:2 + both_parities]:
            engine.allreduce_bucket([comp], bufs_t, members)
        counts.append(_count_ops(lambda: engine.allreduce_bucket([comp], bufs[3], members)))
    assert counts[0] == counts[1], f"operations per step: {counts[0]} for 2 matrices, {counts[1]} for 8"


def test_basis_rows_batched_equals_per_matrix():
    """The batched projection basis equals the per-matrix one (the composition) row for row,
    with a zero row (filled), a dependent row (zeroed) and a NaN row (kept non-finite)."""
    g = torch.Generator().manual_seed(5)
    pt = torch.randn(3, 4, 50, generator=g)
    fill = torch.rand(3, 4, 50, generator=g) * 2 - 1
    pt[1, 2] = 0.0
    pt[2, 3] = pt[2, 0] * 2.0 - pt[2, 1]
    pt[0, 1, 7] = float("nan")
    got = basis_rows_batched(REFERENCE_OPS, 1e-4, pt, fill)
    for b in range(3):
        want = basis_rows(REFERENCE_OPS, 1e-4, pt[b], fill[b])
        assert torch.equal(torch.isfinite(got[b]), torch.isfinite(want))
        ok = torch.isfinite(want)
        assert (got[b][ok] - want[ok]).abs().max().item() < 1e-5


def test_per_matrix_checkpoint_loads_into_a_batch():
    """A checkpoint of per-matrix PowerSGD (today's format: one PowerSGDState per matrix) loaded
    before the first step into batched compressors resumes each matrix's factors and error
    feedback: the next steps equal the per-matrix run's."""
    members = _members()
    grads = _gradients(members, 6)
    engine, ref, _ = _run(_per_matrix_step, 3, members, grads=grads)
    saved = [c.state_dict() for c in ref]
    assert all(set(s["tensors"]["a1"]) >= {"p", "q", "residual"} for s in saved)
    refs = [_per_matrix_step(engine, ref, bufs, members) for bufs in grads[3:]]
    engine2 = SimulatedEngine(RANKS)
    batched = engine2.compressors(SPEC)
    for c, s in zip(batched, saved):
        c.load_state_dict(s)
    outs = [_batched_step(engine2, batched, bufs, members) for bufs in grads[3:]]
    assert _batches(batched[0], members, grads[0][0]) == [("a1", "a2", "a3"), ("c1", "c2")]
    for t, (o, r) in enumerate(zip(outs, refs)):
        for rank in range(RANKS):
            _close(o[rank], r[rank], f"resumed step {t} rank {rank}")


def test_batched_checkpoint_resumes():
    """A batched run saved after 3 steps (each member's error feedback under its key, the stacked
    factors under the batch's group key) resumes into the same layout with outputs equal to the
    run that went on."""
    members = _members()
    grads = _gradients(members, 5)
    engine, batched, _ = _run(_batched_step, 3, members, grads=grads)
    saved = [c.state_dict() for c in batched]
    assert all("buckets" in s for s in saved)
    goes_on = [_batched_step(engine, batched, bufs, members) for bufs in grads[3:]]
    engine2 = SimulatedEngine(RANKS)
    resumed = engine2.compressors(SPEC)
    for c, s in zip(resumed, saved):
        c.load_state_dict(s)
    outs = [_batched_step(engine2, resumed, bufs, members) for bufs in grads[3:]]
    for t, (o, r) in enumerate(zip(outs, goes_on)):
        for rank in range(RANKS):
            _close(o[rank], r[rank], f"resumed step {t} rank {rank}")


def test_rebuilt_buckets_carry_each_matrix_over():
    """Buckets that change (DDP's rebuild, and back): two steps with every matrix in one bucket,
    two with a2, a3 in one bucket (a new batch) and a1 alone in another, two with all in one
    bucket again (a1 back from its own state): the outputs stay equal to per-matrix PowerSGD's
    (each matrix's factors and error feedback carried over each time)."""
    members = _members()
    grads = _gradients(members, 8)
    _, ref, refs = _run(_per_matrix_step, 8, members, grads=grads)
    engine = SimulatedEngine(RANKS)
    batched = engine.compressors(SPEC)
    outs = [_batched_step(engine, batched, bufs, members) for bufs in grads[:2]]
    by_key = {m.key: m for m in members}
    first = ("a2", "a3", "bias")
    second = ("a1", "c1", "odd", "c2")
    for bufs in grads[2:4]:
        full = [torch.zeros_like(b) for b in bufs]
        for keys in (first, second):
            sub, offset = [], 0
            for k in keys:
                m = by_key[k]
                sub.append(Member(k, m.label, m.shape, offset, m.numel))
                offset += m.numel
            got = engine.allreduce_bucket(batched, [torch.cat([b[by_key[k].offset:by_key[k].offset + by_key[k].numel]
                                                              for k in keys]) for b in bufs], tuple(sub))
            for rank in range(RANKS):
                for s in sub:
                    m = by_key[s.key]
                    full[rank][m.offset:m.offset + m.numel] = got[rank][s.offset:s.offset + s.numel]
        outs.append(full)
    sub = tuple(Member(k, by_key[k].label, by_key[k].shape, sum(by_key[j].numel for j in first[:i]), by_key[k].numel)
                for i, k in enumerate(first))
    assert _batches(batched[0], sub, grads[0][0]) == [("a2", "a3")]
    outs += [_batched_step(engine, batched, bufs, members) for bufs in grads[4:]]
    for t, (o, r) in enumerate(zip(outs, refs)):
        for rank in range(RANKS):
            _close(o[rank], r[rank], f"step {t} rank {rank}")


def test_fused_batched_basis_equals_per_matrix_fused():
    """The CPU's fused batched basis (``cpu_powersgd.basis_batched``: the per-matrix C loop over
    the batch) gives each matrix exactly the per-matrix fused form's rows, and is what
    ``ops.fuse`` runs for ``basis_rows_batched`` on the CPU."""
    try:
        from torch_backend.kernels import cpu_powersgd
    except ImportError as exc:  # no C compiler here
        pytest.skip(f"the CPU kernels cannot be built: {exc}")
    from torch_backend.ops import OPS
    g = torch.Generator().manual_seed(6)
    pt = torch.randn(4, 3, 70, generator=g)
    fill = torch.rand(4, 3, 70, generator=g) * 2 - 1
    pt[2, 1] = 0.0
    got = cpu_powersgd.basis_batched(1e-4, pt, fill)
    for b in range(4):
        assert torch.equal(got[b], cpu_powersgd.basis(1e-4, pt[b], fill[b]))
    assert torch.equal(OPS.fuse(basis_rows_batched, 1e-4)(pt, fill), got)
    want = basis_rows_batched(REFERENCE_OPS, 1e-4, pt, fill)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_math_in_each_backend(backend):
    """The batched products and basis (lowrank's ``*_batch``, ``basis_rows_batched``) equal the
    per-matrix ones in each backend (TensorFlow's layout too: transposed views)."""
    import numpy as np
    from hvd_gradcomp.lowrank import (matrix_view, outer, outer_batch, times_left, times_left_batch, times_right,
                                      times_right_batch)
    from tests.backends import as_float64, backend_ops, backend_tensor
    ops = backend_ops(backend)
    rng = np.random.default_rng(4)
    for shape, layout in (((12, 20), "torch"), ((3, 3, 4, 6), "tensorflow"), ((6, 4, 3, 3), "torch")):
        v = matrix_view(shape, layout)
        mats = rng.standard_normal((3,) + v.natural)
        q = rng.standard_normal((3, 2, v.m))
        p = rng.standard_normal((3, 2, v.n))
        t = lambda a: backend_tensor(backend, a)  # noqa: E731
        got = [as_float64(f(ops, t(mats), t(x), v)) for f, x in ((times_right_batch, q), (times_left_batch, p))]
        got.append(as_float64(outer_batch(ops, t(p), t(q), v)))
        for b in range(3):
            want = [as_float64(times_right(ops, t(mats[b]), t(q[b]), v)), as_float64(times_left(ops, t(mats[b]), t(p[b]), v)),
                    as_float64(outer(ops, t(p[b]), t(q[b]), v))]
            for g_, w in zip(got, want):
                np.testing.assert_allclose(g_[b], w, rtol=1e-5, atol=1e-5)
    pt = rng.standard_normal((3, 3, 30))
    pt[1, 1] = 0.0
    fill = rng.uniform(-1, 1, (3, 3, 30))
    got = as_float64(basis_rows_batched(ops, 1e-4, backend_tensor(backend, pt), backend_tensor(backend, fill)))
    for b in range(3):
        want = as_float64(basis_rows(ops, 1e-4, backend_tensor(backend, pt[b]), backend_tensor(backend, fill[b])))
        np.testing.assert_allclose(got[b], want, atol=1e-5)
