"""``auto`` per route group (hvd_gradcomp/auto/group.py) over the N-rank engine
(torch_backend/simulated.py): between windows a bucket's auto tensors on one choice go as one
unit, whose operations per step do not grow with its tensors; on fp16 its output is the
per-tensor run's bit for bit; error feedback balances across windows, groups and a checkpoint
saved while grouped. Decisions come from measured times, so the tests hold whatever is chosen,
except where the only candidate is fp16."""
import pytest

torch = pytest.importorskip("torch")

from hvd_gradcomp.auto.group import AutoGroup  # noqa: E402
from hvd_gradcomp.buckets import Member  # noqa: E402
from torch_backend.simulated import SimulatedEngine  # noqa: E402

LINK = "bandwidth_gbit=0.01,latency_ms=0.1,warmup=2,every=4"
LOSSY = f"auto:{LINK},candidates=fp16|topkc:0.25"
ONLY_FP16 = f"auto:{LINK},candidates=fp16"
SHAPES = (("a", (64, 64)), ("b", (64,)), ("c", (32, 64)), ("d", (48, 64)), ("e", (40, 40)))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _members(shapes=SHAPES):
    out, offset = [], 0
    for key, shape in shapes:
        numel = 1
        for s in shape:
            numel *= s
        out.append(Member(key, key, shape, offset, numel))
        offset += numel
    return tuple(out)


def _grads(members, steps, ranks, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(m.numel for m in members)
    return [[torch.randn(total, generator=g) for _ in range(ranks)] for _ in range(steps)]


def _groups(comp, members, like):
    plan = comp.codec.plan_bucket(members, "float32", "sum", None, like)
    return [tuple(members[i].key for i in u.members) for u in plan.units if isinstance(u.scheme, AutoGroup)]


def _owed(comps, members):
    total = sum(m.numel for m in members)
    owed = torch.zeros(total, dtype=torch.float64)
    for c in comps:
        for m in members:
            ef = c.error_feedback(m.key)
            if ef is not None:
                owed[m.offset:m.offset + m.numel] += ef.double()
    return owed


def test_grouped_between_windows_and_error_feedback_balances():
    """Windows (2 of every 4 steps) per tensor, groups between them; on every rank the
    delivered mean plus the ranks' pending error feedback is the mean of the inputs (fp16
    rounding aside), whichever candidates were chosen."""
    members = _members()
    engine = SimulatedEngine(2)
    comps = engine.compressors(LOSSY)
    grads = _grads(members, 14, 2)
    inputs = torch.zeros(sum(m.numel for m in members), dtype=torch.float64)
    delivered = torch.zeros_like(inputs)
    grouped = []
    for bufs in grads:
        grouped.append(_groups(comps[0], members, bufs[0]))
        out = engine.allreduce_bucket(comps, bufs, members)
        assert torch.equal(out[0], out[1])
        inputs += (bufs[0].double() + bufs[1].double()) / 2
        delivered += out[0].double()
    assert grouped[0] == grouped[1] == [] and any(grouped[2:]), grouped
    gap = (delivered + _owed(comps, members) / 2 - inputs).abs().max().item()
    assert gap < 14 * 2.0 ** -10 * inputs.abs().max().item() + 1e-4, gap


def test_fp16_group_equals_per_tensor():
    """With fp16 the only candidate, a grouped step's output is the per-tensor run's bit for bit
    (each member its own bucket), on both ranks, through windows and groups."""
    members = _members()
    grads = _grads(members, 10, 2, seed=1)
    engine, ref_engine = SimulatedEngine(2), SimulatedEngine(2)
    comps, refs = engine.compressors(ONLY_FP16), ref_engine.compressors(ONLY_FP16)
    for t, bufs in enumerate(grads):
        out = engine.allreduce_bucket(comps, bufs, members)
        for m in members:
            one = (Member(m.key, m.label, m.shape, 0, m.numel),)
            want = ref_engine.allreduce_bucket(refs, [b[m.offset:m.offset + m.numel].clone() for b in bufs], one)
            for r in range(2):
                assert torch.equal(out[r][m.offset:m.offset + m.numel], want[r]), (t, m.key, r)
    assert _groups(comps[0], members, grads[0][0]) == [("a", "c", "d", "e")]


def test_operations_per_step_do_not_grow_with_the_tensors():
    """A plain (grouped) step of 2 and of 6 tensors dispatches as many operations."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    counts = []
    for k in (2, 6):
        members = _members(tuple((f"m{i}", (32, 64)) for i in range(k)))
        engine = SimulatedEngine(1)
        comp, = engine.compressors(ONLY_FP16)
        grads = _grads(members, 4, 1)
        for bufs in grads[:2]:  # the window (steps 0, 1)
            engine.allreduce_bucket([comp], bufs, members)
        assert len(_groups(comp, members, grads[0][0])) == 1
        engine.allreduce_bucket([comp], grads[2], members)  # (the group's first step builds its state)
        Count.n = 0
        with Count():
            engine.allreduce_bucket([comp], grads[3], members)
        counts.append(Count.n)
    assert counts[0] == counts[1], counts


def test_checkpoint_saved_while_grouped_balances():
    """A checkpoint saved on a grouped step (each member's error feedback under its key, the
    group's counters under its key) loaded into new compressors: their first step syncs each
    tensor (float32, what was owed delivered), then they group again; across the two runs the
    delivered mean plus what is still owed is the mean of the inputs. Saved after the first
    step that ran a group (which step that is follows the measured times: a decision may
    regroup the tensors, and a group formed for the next step has no state yet)."""
    members = _members()
    grads = _grads(members, 14, 2, seed=2)
    engine = SimulatedEngine(2)
    comps = engine.compressors(LOSSY)
    inputs = torch.zeros(sum(m.numel for m in members), dtype=torch.float64)
    delivered = torch.zeros_like(inputs)
    saved = None
    for t, bufs in enumerate(grads[:8]):
        out = engine.allreduce_bucket(comps, bufs, members)
        inputs += (bufs[0].double() + bufs[1].double()) / 2
        delivered += out[0].double()
        saved = [c.state_dict() for c in comps]
        if any("buckets" in s for s in saved):
            break
    assert any("buckets" in s for s in saved), "no step of 8 ran a group"
    engine2 = SimulatedEngine(2)
    comps2 = engine2.compressors(LOSSY)
    for c, s in zip(comps2, saved):
        c.load_state_dict(s)
    grouped = []
    for bufs in grads[t + 1:]:
        grouped.append(_groups(comps2[0], members, bufs[0]))
        out = engine2.allreduce_bucket(comps2, bufs, members)
        assert torch.equal(out[0], out[1])
        inputs += (bufs[0].double() + bufs[1].double()) / 2
        delivered += out[0].double()
    assert grouped[0] == [] and any(grouped[1:]), grouped
    gap = (delivered + _owed(comps2, members) / 2 - inputs).abs().max().item()
    assert gap < 12 * 2.0 ** -10 * inputs.abs().max().item() + 1e-4, gap


def test_error_feedback_loaded_into_a_fresh_fp16_tensor_is_delivered():
    """A grouped tensor's checkpoint entry is its error feedback alone; loaded into a fresh state
    whose choice keeps none (fp16), it becomes a carry that the first (sync) step delivers in
    float32: the output is the mean of the inputs plus the mean of what was owed."""
    members = _members()
    grads = _grads(members, 4, 2, seed=3)
    engine = SimulatedEngine(2)
    comps = engine.compressors(ONLY_FP16)
    for bufs in grads[:3]:
        engine.allreduce_bucket(comps, bufs, members)
    saved = [c.state_dict() for c in comps]
    c = next(m for m in members if m.key == "c")
    for r, s in enumerate(saved):
        assert "c" not in s["tensors"]  # grouped on fp16: nothing owed, no entry
        s["tensors"]["c"] = {"error_feedback": torch.full((c.numel,), 0.25 * (r + 1))}
    engine2 = SimulatedEngine(2)
    comps2 = engine2.compressors(ONLY_FP16)
    for comp, s in zip(comps2, saved):
        comp.load_state_dict(s)
    out = engine2.allreduce_bucket(comps2, grads[3], members)
    sl = slice(c.offset, c.offset + c.numel)
    extra = out[0][sl] - (grads[3][0][sl] + grads[3][1][sl]) / 2
    assert (extra - 0.375).abs().max().item() < 1e-5, extra
