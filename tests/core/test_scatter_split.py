"""The reduce-scatter split of a payload (:func:`hvd_gradcomp.composite.scatter_split`), on
simulated ranks in one process (PyTorch primitives).

For each scheme that defines it and 2 or 8 ranks: every rank compresses its own gradient of a
3000-coordinate tensor for four steps; the payloads are summed; one rank (the destination)
decompresses the whole sum, and every rank steps its state from the sum with the values
zeroed (``receive`` and ``finish`` of the agreed part only), as
:func:`~hvd_gradcomp.scattered.decode_scattered` does. Checked against the plain
all-reduce path (:func:`~hvd_gradcomp.base.finish_tensor` of the whole sum on every rank): the
same output bit for bit and the same states (for fp16 at 8 ranks, whose agreed scale the split
keeps at 1/n, the output to float16 rounding instead); the agreed part is integer. And the
schemes without the split answer None.
"""
import numpy as np
import pytest

from hvd_gradcomp import composite
from hvd_gradcomp.base import TensorInfo, compress_tensor, finish_tensor
from tests.backends import backend_tensor, one_rank_ops, scheme_of

D, STEPS = 3000, 4


def _run(spec, n, split_path):
    """Outputs (float64 per step) and final states of ``spec`` on ``n`` simulated ranks."""
    import torch
    ops = one_rank_ops("torch")
    scheme = scheme_of(spec).bind(ops)
    infos = [TensorInfo("w[shard 0/2]", (D,), "float32", n, r, "sum") for r in range(n)]
    like = backend_tensor("torch", np.zeros(D))
    states = [scheme.init(ops, i, like) for i in infos]
    rng = np.random.default_rng(5)
    outs = []
    for _ in range(STEPS):
        sent = [compress_tensor(scheme, ops, backend_tensor("torch", rng.normal(size=D) * (1 + r)), states[r],
                                infos[r]) for r in range(n)]
        total = sum(p.to(torch.float64) for p, _ in sent).to(sent[0][0].dtype)
        if not split_path:
            done = [finish_tensor(scheme, ops, total, c, s, i) for (_, c), s, i in zip(sent, states, infos)]
            outs.append(done[0][0].double().numpy())
            states = [st for _, st in done]
            continue
        v = composite.scatter_split(scheme, infos[0])
        assert v is not None and 0 < v <= total.numel()
        if v < total.numel():
            assert not total.dtype.is_floating_point  # the agreed part sums exactly
        masked = torch.cat([torch.zeros(v, dtype=total.dtype), total[v:]])
        for r, ((_, c), s, i) in enumerate(zip(sent, states, infos)):
            c = scheme.receive(ops, masked, c, i)
            if r == 0:  # the destination
                outs.append(scheme.decompress(ops, total, c, i).double().numpy())
            states[r] = scheme.finish(ops, masked, c, s, i)
    return outs, states


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "thc", "signsgd", "thc:bits=2,error_feedback=false"])
def test_split_equals_all_reduce(spec, n):
    want, want_states = _run(spec, n, split_path=False)
    got, got_states = _run(spec, n, split_path=True)
    if spec == "fp16" and n >= 8:  # the split keeps 1/n: float16 rounding apart
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-3 * np.abs(b).max())
        return
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(got_states, want_states):
        for fa, fb in zip(a, b):
            np.testing.assert_array_equal(fa.numpy(), fb.numpy())


@pytest.mark.parametrize("spec", ["topkc:0.1", "topk:0.1", "powersgd:2", "auto", "thc:range=current"])
def test_no_split(spec):
    info = TensorInfo("w", (64, 64), "float32", 2, 0, "sum")
    assert composite.scatter_split(scheme_of(spec), info) is None


def test_destination_keeps_the_excess():
    """``saturate_output(keep=k)``: the one rank that decodes (a reduce-scatter's destination)
    keeps ``k`` times the mean's excess beyond float16's range in its error feedback, so the
    senders' residuals still balance what was not delivered; without ``keep``, its share."""
    from hvd_gradcomp.base import FP16_MAX, saturate_output
    ops = one_rank_ops("torch")
    scheme = scheme_of("signsgd").bind(ops)
    info = TensorInfo("w", (4,), "float16", 2, 0, "sum")
    state = scheme.init(ops, info, backend_tensor("torch", np.zeros(4)))
    out = backend_tensor("torch", [1.0, FP16_MAX + 96.0, -FP16_MAX - 32.0, 2.0])
    clamped, kept = saturate_output(scheme, ops, out, state, info, FP16_MAX, keep=2.0)
    np.testing.assert_array_equal(clamped.numpy(), [1.0, FP16_MAX, -FP16_MAX, 2.0])

    def pending(st):
        return composite.residual_of(scheme, ops, st, info).numpy()
    np.testing.assert_array_equal(pending(kept), [0.0, 192.0, -64.0, 0.0])
    _, shared = saturate_output(scheme, ops, out, state, info, FP16_MAX)  # Sum: each rank half
    np.testing.assert_array_equal(pending(shared), [0.0, 48.0, -16.0, 0.0])
    assert (pending(state) == 0).all()
