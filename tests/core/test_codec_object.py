"""The codec stands alone (issue 48): a compressor *holds* one :class:`~hvd_gradcomp.codec.Codec`
(its class stack is two classes of ours), and a bare codec, built from a routing, the
primitives, a :class:`~hvd_gradcomp.store.DictStore` and the framework-free
:class:`~hvd_gradcomp.frontend.Frontend`, with no compressor, no Horovod and no process group,
runs a bucket over 2 ranks by hand and gives, bit for bit, what the PyTorch compressors give on
the in-process N-rank engine, for every scheme of the catalogue."""
import pytest

torch = pytest.importorskip("torch")

from hvd_gradcomp import SCHEMES, make_scheme  # noqa: E402
from hvd_gradcomp.buckets import Member  # noqa: E402
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


WRITES_INTO = ("signsgd", "thc")  # the schemes whose decode writes into the engine's buffer


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", ["signsgd", "signsgd:block=1000", "thc", "thc:subtract_own=true", "topkc:0.1",
                                  "fp16"])
def test_decode_into_the_bucket_equals_decode_then_copy(spec):
    """:meth:`Codec.decode`'s ``into`` (the DDP hook's and FSDP's bucket slice): over 3 steps at
    2 ranks on a contiguous bucket, the mean and the states are those of decode-then-copy bit
    for bit; signSGD's and THC's fused decodes write into the slice itself (``divide`` folded
    in), the others return a new tensor and leave the slice alone."""
    n = 2
    members = (Member("w1", "layer.w1", (64, 80), 0, 5120), Member("b1", "layer.b1", (4093,), 5120, 4093))
    size = 5120 + 4093
    ways = [[Codec(Compression.from_spec(spec).routing, OPS, DictStore(OPS), Frontend()).bind_engine(_Rank(r, n))
             for r in range(n)] for _ in range(2)]
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        bufs = [torch.randn(size, generator=gen) * (1 + r) for r in range(n)]
        outs = []
        for into, codecs in enumerate(ways):
            plans = [c.plan_bucket(members, "float32", "sum", None, b) for c, b in zip(codecs, bufs)]
            assert all(u.contiguous for u in plans[0].units)
            encoded = [[c.encode_unit(u, b[u.start:u.stop].view(u.info.shape)) for u in p.units]
                       for c, b, p in zip(codecs, bufs, plans)]
            out = torch.full((size,), 7.0)
            for k, u in enumerate(plans[0].units):
                payloads = [encoded[q][k][0] for q in range(n)]
                summed = (payloads[0] + payloads[1]).to(payloads[0].dtype)
                ctx = encoded[0][k][1]
                dst = out[u.start:u.stop]
                mean = summed / n if ctx is None else codecs[0].decode(summed, ctx, divide=n,
                                                                         into=dst if into else None)
                if into and mean.data_ptr() == dst.data_ptr():
                    assert spec.startswith(WRITES_INTO), f"{spec}: only {WRITES_INTO} write into the bucket"
                else:
                    assert not (into and spec.startswith(WRITES_INTO)), f"{spec}: unit {k} was copied"
                    assert bool((dst == 7.0).all()), f"{spec}: the slice was written and the result is another tensor"
                    dst.copy_(mean.reshape(-1))
            outs.append(out)
        assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32)), f"{spec}: step {step}"
        for key, state in ways[0][0].store.states.items():
            other = ways[1][0].store.states[key]
            assert all(torch.equal(a, b) for a, b in zip(state, other) if isinstance(a, torch.Tensor)), key


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
