"""The in-process N-rank engine (torch_backend/simulated.py): the reduction as a collective's,
and one-process codec tests over it for every scheme of the catalogue (``SCHEMES``, filtered by
the schemes' flags: a scheme that measures its link, ``adaptive``, is given one)."""
import pytest

torch = pytest.importorskip("torch")

from hvd_gradcomp import SCHEMES, make_scheme  # noqa: E402
from hvd_gradcomp.buckets import Member  # noqa: E402
from torch_backend import Compression  # noqa: E402
from torch_backend.simulated import SimulatedEngine  # noqa: E402


def _spec(name):
    """The catalogue's default spec of ``name``; an adaptive scheme gets a link (one process
    has none to measure)."""
    return f"{name}:bandwidth_gbit=10" if make_scheme(name).adaptive else name


CATALOGUE = [_spec(n) for n in SCHEMES if not make_scheme(n).blocking]
# Schemes whose decoded mean is the mean (casts and none), within the payload dtype's rounding.
CASTS = {"none": 1e-6, "fp16": 2e-3, "bf16": 1.6e-2}

# A bucket of three members: a matrix, a vector, and a gap before the third (non-contiguous
# flat group), each above every scheme's min_numel.
MEMBERS = (Member("w1", "layer.w1", (64, 80), 0, 5120), Member("b1", "layer.b1", (4096,), 5120, 4096),
           Member("w2", "layer.w2", (96, 64), 9216 + 512, 6144))
SIZE = 9216 + 512 + 6144


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _buffers(n, step, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + step)
    out = []
    for _ in range(n):
        b = torch.randn(SIZE, generator=g)
        b[9216:9216 + 512] = 0.0  # the gap: no member
        out.append(b)
    return out


# ---- the reduction ----
def test_integers_summed_exactly_and_wrapped():
    e = SimulatedEngine(3)
    big = 2 ** 31 - 5
    xs = [torch.tensor([big, -big, 7, 0], dtype=torch.int32) for _ in range(3)]
    got = e.reduce(xs)
    want = [((3 * v + 2 ** 31) % 2 ** 32) - 2 ** 31 for v in (big, -big, 7, 0)]
    assert got.dtype == torch.int32 and got.tolist() == want


def test_floats_summed_in_ring_order():
    """Chunk c of the flat payload accumulates ranks c, c+1, ... (mod n), rounding each sum to
    float16: a value that the first summand absorbs differs from the naive rank-0-first order."""
    n, m = 3, 6
    xs = [torch.zeros(m, dtype=torch.float16) for _ in range(n)]
    for r in range(n):  # rank r: 2048 at chunk r's elements, 1 elsewhere
        xs[r][:] = 1.0
        xs[r][2 * r:2 * r + 2] = 2048.0
    got = SimulatedEngine(n).reduce(xs)
    want = []
    for i in range(m):
        c = i * n // m
        acc = xs[c][i]
        for j in range(1, n):
            acc = (acc.float() + xs[(c + j) % n][i].float()).half()
        want.append(float(acc))
    # 2048 + 1 rounds to 2048 in float16 (ring order); 1 + 1 + 2048 would be 2050
    assert got.tolist() == want == [2048.0] * m


def test_average_as_horovod_cpu():
    e = SimulatedEngine(3, op="average")
    ints = e.reduce([torch.tensor([1, -1, 3], dtype=torch.int32)] * 3)
    assert ints.tolist() == [int(3 * 1 * (1 / 3)), int(-3 * (1 / 3)), int(9 * (1 / 3))]
    floats = e.reduce([torch.tensor([1.0, 2.0])] * 3)
    assert floats.tolist() == pytest.approx([1.0, 2.0])


def test_mismatched_payloads_refused():
    e = SimulatedEngine(2)
    with pytest.raises(ValueError, match="rank 1 sent"):
        e.reduce([torch.zeros(3), torch.zeros(4)])


# ---- the codec over N ranks, every scheme of the catalogue ----
@pytest.mark.parametrize("spec", CATALOGUE)
@pytest.mark.parametrize("n", [2, 5])
def test_every_rank_decodes_the_same_mean(spec, n):
    e = SimulatedEngine(n)
    comps = e.compressors(spec)
    for step in range(3):
        bufs = _buffers(n, step)
        outs = e.allreduce_bucket(comps, bufs, MEMBERS)
        for r in range(1, n):
            assert torch.equal(outs[r], outs[0]), f"{spec}: rank {r} decoded otherwise than rank 0"
        assert torch.all(outs[0][9216:9216 + 512] == 0)  # no member there
        mean = torch.stack(bufs).mean(0)
        tol = CASTS.get(spec)
        if tol is not None:
            assert torch.allclose(outs[0], mean, rtol=tol, atol=tol), spec
        elif step == 2:  # compressed: an estimate of the mean, correlated with it (THC's
            # first step has no range yet: range="previous")
            cos = torch.nn.functional.cosine_similarity(outs[0], mean, dim=0)
            assert cos > 0.05, f"{spec}: decoded mean uncorrelated with the mean (cos {cos:.3f})"


@pytest.mark.parametrize("spec", [s for s in CATALOGUE if s.split(":")[0] not in ("none",)])
def test_per_rank_state(spec):
    """Every rank keeps its own state: the fields the ranks agree on are equal on every rank,
    the rank-local ones (error feedback) are each rank's own."""
    n = 3
    e = SimulatedEngine(n)
    comps = e.compressors(spec)
    for step in range(2):
        e.allreduce_bucket(comps, _buffers(n, step), MEMBERS)
    states = [c.state_dict() for c in comps]
    assert [s["rank"] for s in states] == list(range(n))
    local = set()
    for name in SCHEMES:
        local.update(make_scheme(name).rank_local_fields)
    local.add("error_feedback")
    differs = False
    for key, fields in states[0]["tensors"].items():
        for f, v in fields.items():
            others = [s["tensors"][key][f] for s in states[1:]]
            if f in local:
                differs |= any(not torch.equal(v, o) for o in others if v.numel())
            else:
                assert all(torch.equal(v, o) for o in others), f"{spec}: {key}.{f} differs between ranks"
    holds_feedback = any(f in local and v.numel() and bool(v.abs().sum() > 0)
                         for fields in states[0]["tensors"].values() for f, v in fields.items())
    assert differs or not holds_feedback, f"{spec}: every rank holds the same error feedback"


@pytest.mark.parametrize("spec", CATALOGUE)
def test_bucket_of_several_members_against_one_by_one(spec):
    """The bucket's decoded members have the shapes and order of one-member buckets; for the
    casts, bit for bit the result of each tensor sent alone."""
    n = 2
    e, alone = SimulatedEngine(n), SimulatedEngine(n)
    comps, solo = e.compressors(spec), alone.compressors(spec)
    bufs = _buffers(n, 0)
    outs = e.allreduce_bucket(comps, bufs, MEMBERS)
    plan = comps[0].codec.plan_bucket(MEMBERS, "float32", "sum", None, bufs[0])
    assert sum(len(u.members) for u in plan.units) == len(MEMBERS)
    for m in MEMBERS:
        parts = [b[m.offset:m.offset + m.numel].clone() for b in bufs]
        got = alone.allreduce_bucket(solo, parts, [m._replace(offset=0)])
        assert got[0].shape == (m.numel,)
        if spec in CASTS:
            assert torch.equal(got[0], outs[0][m.offset:m.offset + m.numel]), f"{spec}: {m.key}"


# An adaptive scheme re-decides after a load from its measured codec times (timing-dependent):
# not comparable bit for bit.
@pytest.mark.parametrize("spec", [s for s in CATALOGUE if not make_scheme(s.split(":")[0]).adaptive])
def test_checkpoint_round_trip(spec):
    """Gathered checkpoints (an object gather on every rank: engine.run) load into new
    compressors, one per rank, which then decode exactly what the saved ones do."""
    n = 3
    e = SimulatedEngine(n)
    comps = e.compressors(spec)
    for step in range(2):
        e.allreduce_bucket(comps, _buffers(n, step), MEMBERS)
    saved = e.run(lambda r: comps[r].state_dict(gather=True))
    assert all(len(s["ranks"]) == n for s in saved)
    e2 = SimulatedEngine(n)
    fresh = e2.bind([Compression.from_spec(spec) for _ in range(n)])
    e2.run(lambda r: fresh[r].load_state_dict(saved[0]))
    bufs = _buffers(n, 2)
    want = e.allreduce_bucket(comps, bufs, MEMBERS)
    got = e2.allreduce_bucket(fresh, bufs, MEMBERS)
    for r in range(n):
        assert torch.equal(got[r], want[r]), f"{spec}: rank {r} after the round trip"


# ---- refusals and collectives outside compress ----
def test_blocking_variant_refused():
    blocking = [n for n in SCHEMES if make_scheme(n).blocking]
    specs = blocking or ["thc:range=current"]
    for spec in specs:
        with pytest.raises(ValueError, match="blocking"):
            SimulatedEngine(2).compressors(spec)


def test_adaptive_without_link_refused():
    adaptive = [n for n in SCHEMES if make_scheme(n).adaptive]
    for name in adaptive:
        with pytest.raises(ValueError, match="link"):
            SimulatedEngine(2).compressors(name)


def test_collective_outside_run_and_a_failing_rank():
    e = SimulatedEngine(2, timeout_s=30)
    comps = e.compressors("topkc:0.1")
    e.allreduce_bucket(comps, _buffers(2, 0), MEMBERS)
    with pytest.raises(RuntimeError, match="outside SimulatedEngine.run"):
        comps[0].state_dict(gather=True)

    def fn(r):
        if r == 1:
            raise KeyError("rank 1 failed")
        return comps[r].state_dict(gather=True)
    with pytest.raises(KeyError, match="rank 1 failed"):  # rank 0 is released, not left waiting
        e.run(fn)
    assert e.run(lambda r: r * 10) == [0, 10]


def test_shared_or_foreign_compressor_refused():
    e = SimulatedEngine(2)
    c = Compression.fp16()
    with pytest.raises(ValueError, match="its own"):
        e.bind([c, c])
    comps = e.compressors("fp16")
    with pytest.raises(ValueError, match="bound"):
        SimulatedEngine(2).allreduce_bucket(comps, _buffers(2, 0), MEMBERS)
