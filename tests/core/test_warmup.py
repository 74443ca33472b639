"""``fp16_warmup=N`` at the scheme level, one process, in each backend: several ranks of one
tensor simulated as in tests/core/test_topkc.py (payloads summed in their dtype, Average
scaled by 1/n; a rank in ``hvd.join()`` contributes zeros and runs nothing), checked against
float64 references: the FP16 steps, the hand-over (payload size, seeded state) and that the
ranks hand over together when a rank joins or its count differs. The real 2-rank runs are in
tests/parallel/test_warmup.py.
"""
import numpy as np
import pytest

from hvd_gradcomp import composite
from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.registry import make_scheme, parse_spec, to_spec
from hvd_gradcomp.routing import Routing
from hvd_gradcomp.warmup import WarmupScheme
from tests.backends import BACKENDS, as_float64, backend_tensor, one_rank_ops
from tests.reference import RefTopKCEF21, allreduce_fp16, fp16

SHAPE = (7, 13)  # 91 coordinates, 12 chunks of 8
D = 91


class Sim:
    """``n`` ranks of one tensor; ``step(grads, joined=())``: the ranks in ``joined`` take no
    part (zeros in the sum, no compress, no finish)."""

    def __init__(self, backend, n, op, spec, shape=SHAPE):
        self.ops, self.backend, self.n, self.op = one_rank_ops(backend), backend, n, op
        name, options = parse_spec(spec)
        # One scheme per rank, as in one process per rank (the warm-up mirrors its count on the host).
        self.schemes = [make_scheme(name, **options) for _ in range(n)]
        self.infos = [TensorInfo("w", shape, "float32", n, r, op) for r in range(n)]
        like = backend_tensor(backend, np.zeros(shape))
        self.states = [s.init(self.ops, i, like) for s, i in zip(self.schemes, self.infos)]

    def step(self, grads, joined=()):
        sent = {r: compress_tensor(self.schemes[r], self.ops, backend_tensor(self.backend, g), self.states[r], self.infos[r])
                for r, g in enumerate(grads) if r not in joined}
        sizes = {int(np.prod(self.ops.shape(p))) for p, _ in sent.values()}
        assert len(sizes) == 1, f"ranks post different payload sizes {sizes} (Horovod would refuse)"
        payloads = [p for p, _ in sent.values()]
        reduced = payloads[0] * 0
        for r in range(self.n):  # Horovod's order; a joined rank adds zeros
            reduced = reduced + (sent[r][0] if r in sent else payloads[0] * 0)
        if self.op == "average":
            reduced = reduced * (1.0 / self.n)
        outs = {}
        for r, (_, ctx) in sent.items():
            out, self.states[r] = finish_tensor(self.schemes[r], self.ops, reduced, ctx, self.states[r], self.infos[r])
            outs[r] = as_float64(out)
        self.size = sizes.pop()
        return outs


def _grads(gen, n):
    return [(gen.standard_normal(SHAPE) * gen.uniform(0.1, 3.0, SHAPE).round(1)).astype(np.float32).astype(np.float64)
            for _ in range(n)]


def _fp16_ref(grads, op):
    n = len(grads)
    return allreduce_fp16([fp16(g.reshape(-1) / n) for g in grads], op) * n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["sum", "average"])
def test_warmup_then_ef21(backend, op):
    """3 FP16 steps (the fp16 scheme's values, payload d + 2), then TopKC EF21 seeded from the
    last one (h_i = own decoded gradient, H = aggregate, scores = its chunk norms) and from
    then on the float64 EF21 recursion."""
    n = 2
    sim = Sim(backend, n, op, "topkc:0.25,chunk=8,payload_dtype=float32,error_feedback=ef21,fp16_warmup=3")
    gen = np.random.default_rng(1)
    for step in range(3):
        grads = _grads(gen, n)
        outs = sim.step(grads)
        expected = _fp16_ref(grads, op)
        for r in range(n):
            np.testing.assert_allclose(outs[r].reshape(-1), expected, rtol=0, atol=1e-6 * np.abs(expected).max())
            assert int(sim.states[r].warmup) == (step + 1 if step < 2 else -1)
        assert sim.size == D + 2
    ref = RefTopKCEF21(D, n, 0.25, 8, "float32")
    ref.h = [fp16(g.reshape(-1) / n) * n for g in grads]
    ref.H = expected
    chunks = np.concatenate([expected, np.zeros(96 - D)]).reshape(12, 8)
    norms = (chunks ** 2).sum(1)
    ref.prev = norms / norms.max()
    for r in range(n):
        np.testing.assert_allclose(as_float64(sim.states[r].local), ref.h[r], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(as_float64(sim.states[r].scores), ref.prev, rtol=1e-5, atol=1e-6)
    for step in range(4):
        grads = _grads(gen, n)
        outs = sim.step(grads)
        expected = ref.step(grads, op)
        assert sim.size == 3 * 8 + 12 + 16
        for r in range(n):
            np.testing.assert_allclose(outs[r].reshape(-1), expected, rtol=0, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ["topkc:0.25,chunk=8", "thc", "powersgd:2", "topk:0.1", "bf16"])
def test_warmup_any_scheme(backend, spec):
    """Every scheme: N FP16 steps, then its own payload, on both ranks at the same step."""
    n, op = 2, "sum"
    sim = Sim(backend, n, op, spec + ("," if ":" in spec else ":") + "fp16_warmup=2")
    gen = np.random.default_rng(2)
    for step in range(4):
        grads = _grads(gen, n)
        outs = sim.step(grads)
        if step < 2:
            assert sim.size == D + 2
            np.testing.assert_allclose(outs[0].reshape(-1), _fp16_ref(grads, op), rtol=0, atol=1e-2)
        else:
            assert sim.size != D + 2 or spec == "bf16"
            assert all(int(s.warmup) == -1 for s in sim.states)
        np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["sum", "average"])
def test_warmup_held_back_while_a_rank_is_joined(backend, op):
    """3 ranks, N = 2: rank 2 joins after one step; the others stay on FP16 (same payload
    size) until it is back, then all three hand over at the same step."""
    n = 3
    sim = Sim(backend, n, op, "topkc:0.25,chunk=8,error_feedback=ef21,fp16_warmup=2")
    gen = np.random.default_rng(3)
    sim.step(_grads(gen, n))
    for _ in range(3):  # rank 2 in hvd.join(): zeros, the others contribute
        grads = _grads(gen, n)
        outs = sim.step(grads, joined=(2,))
        assert sim.size == D + 2
        part = _fp16_ref(grads[:2] + [np.zeros(SHAPE)], op)
        np.testing.assert_allclose(outs[0].reshape(-1), part, rtol=0, atol=2e-3 * np.abs(part).max())
    assert [int(s.warmup) for s in sim.states] == [4, 4, 1]
    sim.step(_grads(gen, n))  # rank 2 back, still counting 1: all FP16, all hand over
    assert sim.size == D + 2 and [int(s.warmup) for s in sim.states] == [-1, -1, -1]
    outs = sim.step(_grads(gen, n))
    assert sim.size == 3 * 8 + 12 + 16
    np.testing.assert_array_equal(outs[0], outs[2])
    assert all(int(s.realigned) == 0 for s in sim.states)


@pytest.mark.parametrize("backend", BACKENDS)
def test_warmup_counts_that_differ_hand_over_together(backend):
    """Rank 1's count is behind (a checkpoint of an earlier step loaded there): both hand
    over when rank 0 is ready, within one step; a failed step counts nothing."""
    n = 2
    sim = Sim(backend, n, "average", "topkc:0.25,chunk=8,fp16_warmup=3")
    gen = np.random.default_rng(4)
    sim.step(_grads(gen, n))
    early = sim.states[1]
    sim.step(_grads(gen, n))
    sim.states[1] = early
    composite.forget(sim.schemes[1], "w")  # what the adapters do when they load a state
    assert [int(s.warmup) for s in sim.states] == [2, 1]
    grads = _grads(gen, n)
    grads[0][0, 0] = np.inf
    outs = sim.step(grads)
    assert not np.isfinite(outs[0]).all() and [int(s.warmup) for s in sim.states] == [2, 1]
    sim.step(_grads(gen, n))
    assert [int(s.warmup) for s in sim.states] == [-1, -1]
    sim.step(_grads(gen, n))
    assert sim.size == 3 * 8 + 12 + 16


def test_warmup_spec_and_factory():
    s = make_scheme("topkc", 0.1, fp16_warmup=20)
    assert isinstance(s, WarmupScheme) and s.steps == 20
    assert to_spec(s) == "topkc:ratio=0.1,fp16_warmup=20"
    assert Routing.from_spec("thc:fp16_warmup=5,min_numel=64").spec() == "thc:fp16_warmup=5,min_numel=64"
    assert not isinstance(make_scheme("topkc", fp16_warmup=0), WarmupScheme)
    assert not isinstance(make_scheme("fp16", fp16_warmup=5), WarmupScheme)
    with pytest.raises(ValueError, match=r"^thc: fp16_warmup must be an integer >= 0, got -1$"):
        make_scheme("thc", fp16_warmup=-1)
    with pytest.raises(ValueError, match=r"^thc: fp16_warmup must be an integer >= 0, got 'x'$"):
        parse_spec("thc:fp16_warmup=x")
    with pytest.raises(ValueError, match="not for an adaptive scheme"):
        make_scheme("auto", fp16_warmup=5)


def test_transformer_rules():
    """The transformer rule set keeps embeddings, norms, biases and heads on fp16 (PyTorch
    and Hugging Face names) and sends the other matrices with the default."""
    from hvd_gradcomp.routing import TRANSFORMER_FP16, transformer_spec
    routing = Routing.from_spec(transformer_spec("topkc:0.1,error_feedback=ef21,fp16_warmup=20"))
    fp16_names = ["embed.weight", "pos", "blocks.layers.0.norm1.weight", "norm.bias", "head.weight",
                  "blocks.layers.1.self_attn.in_proj_bias", "transformer.wte.weight", "transformer.wpe.weight",
                  "transformer.h.0.ln_1.weight", "bert.encoder.layer.0.output.LayerNorm.weight", "lm_head.weight"]
    for name in fp16_names:
        assert routing.decide(name, 1 << 20).scheme.name == "fp16", name
    for name in ["blocks.layers.0.linear1.weight", "blocks.layers.1.self_attn.in_proj_weight",
                 "transformer.h.0.mlp.c_fc.weight"]:
        route = routing.decide(name, 1 << 20)
        assert route.text == "topkc:ratio=0.1,error_feedback=ef21,fp16_warmup=20", name
    assert len(routing.rules) == len(TRANSFORMER_FP16)
    assert Routing.from_spec(routing.spec()).spec() == routing.spec()
