"""The codec stands alone (issue 48): a compressor *holds* one :class:`~hvd_gradcomp.codec.Codec`
(its class stack is two classes of ours), and a bare codec, built from a routing, the
primitives, a :class:`~hvd_gradcomp.store.DictStore` and the framework-free
:class:`~hvd_gradcomp.frontend.Frontend`, with no compressor, no Horovod and no process group,
runs a bucket over 2 ranks by hand and gives, bit for bit, what the PyTorch compressors give on
the in-process N-rank engine, for every scheme of the catalogue."""
import pytest

torch = pytest.importorskip("torch")

from hvd_gradcomp import SCHEMES, make_scheme  # noqa: E402
from hvd_gradcomp.codec import Codec  # noqa: E402
from hvd_gradcomp.frontend import Frontend  # noqa: E402
from hvd_gradcomp.store import DictStore  # noqa: E402
from torch_backend import OPS, Compression  # noqa: E402
from torch_backend.simulated import SimulatedEngine  # noqa: E402

from tests.core.test_simulated import MEMBERS, _buffers, _spec  # noqa: E402

PROJECT = ("hvd_gradcomp", "torch_backend", "tf_backend")
CATALOGUE = [_spec(n) for n in SCHEMES if not make_scheme(n).blocking]


def _ours(cls) -> list:
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] in PROJECT]


def test_compressor_holds_a_codec_and_two_classes_of_ours():
    comp = Compression.thc()
    assert [c.__name__ for c in _ours(type(comp))] == ["Compressor", "HorovodCompressor"]
    assert _ours(Codec) == [Codec] and isinstance(comp.codec, Codec)
    assert comp.codec.store is not None and comp.codec.frontend is not None


def test_tf_compressor_two_classes_of_ours():
    pytest.importorskip("tensorflow")
    from tf_backend import Compression as TFCompression
    assert [c.__name__ for c in _ours(type(TFCompression.thc()))] == ["Compressor", "HorovodCompressor"]


class _Rank:
    """A rank's engine for a bare codec: the world only (the payloads are summed by hand)."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def world(self):
        return self.size, self.rank

    def gather(self, obj):
        raise RuntimeError("not used by this test")

    allreduce = post = wait = gather


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", CATALOGUE)
def test_bare_codec_equals_the_compressors(spec):
    n, steps = 2, 3
    engine = SimulatedEngine(n)
    comps = engine.compressors(spec)
    bare = [Codec(Compression.from_spec(spec).routing, OPS, DictStore(OPS), Frontend()).bind_engine(_Rank(r, n))
            for r in range(n)]
    for step in range(steps):
        bufs = _buffers(n, step, seed=7)
        want = engine.allreduce_bucket(comps, [b.clone() for b in bufs], MEMBERS)
        plans = [c.plan_bucket(MEMBERS, "float32", "sum", None, b) for c, b in zip(bare, bufs)]
        encoded = [[c.encode_unit(u, (b[u.start:u.stop] if u.contiguous else b.index_select(0, u.index))
                                  .view(u.info.shape)) for u in p.units]
                   for c, b, p in zip(bare, bufs, plans)]
        for r in range(n):
            out = torch.zeros_like(bufs[r])
            for k, u in enumerate(plans[r].units):
                payloads = [encoded[q][k][0] for q in range(n)]
                summed = payloads[0].to(torch.int64) + payloads[1].to(torch.int64) if not payloads[0].is_floating_point() \
                    else payloads[0] + payloads[1]  # two ranks: one addition, as any collective does it
                summed = summed.to(payloads[0].dtype)
                ctx = encoded[r][k][1]
                mean = summed / n if ctx is None else bare[r].decode(summed, ctx, divide=n)
                if u.contiguous:
                    out[u.start:u.stop] = mean.reshape(-1)
                else:
                    out[u.index] = mean.reshape(-1)
            assert torch.equal(out, want[r]), f"{spec}: step {step}, rank {r}"
    assert sorted(bare[0].store.states) == sorted(k for k in comps[0].codec.store.states)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", CATALOGUE + ["thc:error_feedback=false,subtract_own=true",
                                             "auto:candidates=thc:subtract_own=true|fp16,bandwidth_gbit=0.01"])
def test_a_rank_that_sent_zeros_decodes_its_peers_mean(spec):
    """DDP's ``Join`` under the delayed hook: after 6 steps of both ranks (auto: its window, then
    its choices: THC on a group), rank 1 posts zeros in place of its payload, and decoding the
    sum with :meth:`Codec.as_sent_zeros` of its ctx gives rank 0's result bit for bit (a scheme
    that takes its own words off the sum, ``subtract_own``, takes zeros off)."""
    n, steps = 2, 7
    bare = [Codec(Compression.from_spec(spec).routing, OPS, DictStore(OPS), Frontend()).bind_engine(_Rank(r, n))
            for r in range(n)]
    for step in range(steps):
        joined = step == steps - 1
        bufs = _buffers(n, step, seed=11)
        plans = [c.plan_bucket(MEMBERS, "float32", "sum", None, b) for c, b in zip(bare, bufs)]
        for k, u in enumerate(plans[0].units):
            x = [(b[u.start:u.stop] if u.contiguous else b.index_select(0, u.index)).view(u.info.shape) for b in bufs]
            (p0, c0), (p1, c1) = bare[0].encode_unit(u, x[0]), bare[1].encode_unit(plans[1].units[k], x[1])
            if c0 is None:
                continue
            summed = p0 + (torch.zeros_like(p1) if joined else p1)  # (two ranks: one addition)
            mine = bare[0].decode(summed.clone(), c0, divide=n)
            theirs = bare[1].decode(summed.clone(), bare[1].as_sent_zeros(c1) if joined else c1, divide=n)
            assert torch.equal(mine, theirs), f"{spec}: step {step}, unit {k} ({u.info.key})"
