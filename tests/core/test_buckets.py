"""The bucketed codec's state (hvd_gradcomp/buckets.py) in one process, over the N-rank engine
(torch_backend/simulated.py): error feedback follows each tensor while the bucket layouts that
hold it change, for every scheme of the catalogue that keeps error feedback (``SCHEMES``,
filtered by the schemes' flags)."""
import pytest

torch = pytest.importorskip("torch")

from hvd_gradcomp import SCHEMES, make_scheme  # noqa: E402
from hvd_gradcomp.buckets import Member  # noqa: E402
from torch_backend.simulated import SimulatedEngine  # noqa: E402


def _keeps_error_feedback(name) -> bool:
    """Not none or the casts (``identity``, ``linear``: they keep none), not ``auto`` or the
    blocking variants (one process has no link to measure, no side collective)."""
    s = make_scheme(name)
    return not (s.identity or s.linear or s.adaptive or s.blocking)


def _spec(name) -> str:
    """The default spec; a decayed error feedback (SparseLoCo's ``decay``) set to 1, where what
    is owed is exactly what was not delivered."""
    return f"{name}:decay=1" if hasattr(make_scheme(name).config, "decay") else name


EF_SCHEMES = [_spec(n) for n in SCHEMES if _keeps_error_feedback(n)]

# Three matrices (PowerSGD's too), each above every scheme's min_numel; P is in the bucket only
# every other step.
SHAPES = {"A": (64, 64), "P": (32, 64), "B": (48, 64)}
SIZES = {k: r * c for k, (r, c) in SHAPES.items()}


def _members(keys):
    out, offset = [], 0
    for k in keys:
        out.append(Member(k, f"layer.{k}", SHAPES[k], offset, SIZES[k]))
        offset += SIZES[k]
    return tuple(out)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("name", EF_SCHEMES)
def test_error_feedback_balance_across_layouts(name):
    """One rank; buckets over A, P, B, then A, B, then A, P, B, ... (a group's members change
    back and forth). Per tensor, what was delivered plus what is still owed is the sum of its
    inputs (float rounding aside): no error feedback lost, none sent twice."""
    e = SimulatedEngine(1)
    comp, = e.compressors(name)
    g = torch.Generator().manual_seed(7)
    layouts = [("A", "P", "B"), ("A", "B")]
    inputs = {k: torch.zeros(n, dtype=torch.float64) for k, n in SIZES.items()}
    delivered = {k: torch.zeros(n, dtype=torch.float64) for k, n in SIZES.items()}
    for step in range(7):
        members = _members(layouts[step % 2])
        buf = torch.randn(sum(m.numel for m in members), generator=g)
        out, = e.allreduce_bucket([comp], [buf], members)
        for m in members:
            inputs[m.key] += buf[m.offset:m.offset + m.numel].double()
            delivered[m.key] += out[m.offset:m.offset + m.numel].double()
    for k in SIZES:
        owed = comp.error_feedback(k)
        assert owed is not None, f"{name}: {k} keeps no error feedback"
        gap = (delivered[k] + owed.double() - inputs[k]).abs().max().item()
        assert gap < 1e-3, f"{name}: tensor {k}: delivered + owed - inputs is off by {gap:.3g}"


@pytest.mark.parametrize("name", EF_SCHEMES)
def test_error_feedback_balance_through_a_checkpoint(name):
    """The same back and forth, saved while the group of A, P, B holds stale slices of A and B
    (they are in the group of A, B), loaded into a new compressor that goes on: the balance
    holds across the checkpoint (the stale slices are not resumed as A's and B's)."""
    from torch_backend import Compression
    e, e2 = SimulatedEngine(1), SimulatedEngine(1)
    comp, = e.compressors(name)
    g = torch.Generator().manual_seed(11)
    layouts = [("A", "P", "B"), ("A", "B")]
    inputs = {k: torch.zeros(n, dtype=torch.float64) for k, n in SIZES.items()}
    delivered = {k: torch.zeros(n, dtype=torch.float64) for k, n in SIZES.items()}
    for step in range(6):
        if step == 2:
            fresh, = e2.bind([Compression.from_spec(name)])
            fresh.load_state_dict(comp.state_dict())
            comp, e = fresh, e2
        members = _members(layouts[step % 2])
        buf = torch.randn(sum(m.numel for m in members), generator=g)
        out, = e.allreduce_bucket([comp], [buf], members)
        for m in members:
            inputs[m.key] += buf[m.offset:m.offset + m.numel].double()
            delivered[m.key] += out[m.offset:m.offset + m.numel].double()
    for k in SIZES:
        gap = (delivered[k] + comp.error_feedback(k).double() - inputs[k]).abs().max().item()
        assert gap < 1e-3, f"{name}: tensor {k}: delivered + owed - inputs is off by {gap:.3g}"


# ---- the packing every engine shares (hvd_gradcomp/payloads.py) ----
def test_pack_payloads_layout_and_copy():
    """One flat buffer per payload dtype, in the dtypes' name order, payloads in the order given;
    a dtype's sole 1-D payload is its buffer unless ``copy`` (FSDP's overlap zeroes the gradient
    buffer a payload may view while the all-reduce is in flight)."""
    from hvd_gradcomp.payloads import pack_payloads, unpack_payloads
    from torch_backend import OPS
    a, b = torch.arange(6, dtype=torch.int32).view(2, 3), torch.ones(4, dtype=torch.float16)
    c = torch.arange(3, dtype=torch.int32)
    packed = pack_payloads(OPS, [a, b, c])
    assert [str(x.dtype) for x in packed.buffers] == ["torch.float16", "torch.int32"]
    assert packed.buffers[0] is b and packed.buffers[1].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    got = unpack_payloads(OPS, packed)
    assert all(torch.equal(x, y) for x, y in zip(got, [a, b, c]))
    copied = pack_payloads(OPS, [a, b, c], copy=True)
    assert copied.buffers[0] is not b and copied.buffers[0].data_ptr() != b.data_ptr()
    copied.buffers[0].zero_()
    assert torch.equal(b, torch.ones(4, dtype=torch.float16))
