"""The contract every scheme in the catalogue keeps, in each backend, at the scheme level.

These run one process with the side collective replaced by the identity (world size 1, so
an all-reduce of one rank *is* the identity); everything multi-rank is in tests/parallel/.

Checked for every entry of ``SCHEMES`` with default options, and for the variants of
``EXTRA`` (TopKC's blocking form, an fp32 payload with odd chunks, none's float32 payload); every scheme is
checked on small tensors too (a scheme has no size threshold: the routing decides which
tensors go as fp16, see hvd_gradcomp/routing.py); a tensor a scheme does not accept
(``Scheme.accepts``: PowerSGD's vectors) runs on its fallback, as the routing sends it:
- dtype and shape survive compress + finish (0-d, 1-d, 2-d, 4-d, fp16/bf16/fp32/fp64),
- zeros give exact zeros,
- error feedback: (grad + old residual) == locally decoded payload + new residual (float64),
- payload size depends only on shape, dtype, config and world size,
- wire() matches the payload actually produced.
"""

from typing import NamedTuple

import numpy as np
import pytest

from hvd_gradcomp import composite
from hvd_gradcomp.base import EmptyState, Scheme, TensorInfo, compress_tensor, finish_tensor
from hvd_gradcomp.powersgd import PowerSGDState
from hvd_gradcomp.primitives import itemsize
from hvd_gradcomp.registry import SCHEMES, make_scheme
from hvd_gradcomp.routing import Routing
from tests.backends import BACKENDS, as_float64, backend_tensor, one_rank_ops, scheme_steps

SHAPES = [(), (7,), (64, 48), (8, 4, 3, 3), (5000,)]
DTYPES = ["float32", "float16", "bfloat16", "float64"]
# (name, options): every scheme with its defaults, plus TopKC's blocking ("current") form, an
# fp32 payload with chunks that do not divide the tensors, none's float32 payload and the
# PowerSGD whose refused tensors go that way.
EXTRA = [("topkc", {"selection": "current"}),
         ("topkc", {"chunk": 7, "ratio": 0.3, "payload_dtype": "float32"}),
         ("none", {"dtype": "float32"}), ("powersgd", {"uncompressed_dtype": "float32"})]
# auto needs a link to decide from (a single rank never crosses one: it keeps fp16).
DEFAULTS = {"auto": {"bandwidth_gbit": 1.0}}
VARIANTS = [(name, DEFAULTS.get(name, {})) for name in sorted(SCHEMES)] + EXTRA
IDS = [name + "".join(f"-{k}={v}" for k, v in opts.items()) for name, opts in VARIANTS]


_tensor, _to_numpy = backend_tensor, as_float64  # the shared helpers of tests/backends.py


def _values(shape, seed):
    import numpy as np
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape)


def _for(scheme, shape):
    """The scheme the routing sends a float32 tensor of ``shape`` with, size routing off:
    ``scheme``, or its fallback where it does not accept the tensor."""
    return Routing.single(scheme, 1).decide("t", TensorInfo("t", tuple(shape), "float32", 1, 0)).scheme


def _roundtrip(backend, scheme, x, key="t", steps=1):
    """``steps`` steps on ``x``; the last step's (out, payload, old state, state after, info)."""
    ops = one_rank_ops(backend)
    info = TensorInfo(key, ops.shape(x), ops.dtype(x), 1, 0)
    last = scheme_steps(ops, scheme, [x] * steps, info)[-1]
    return last["out"], last["payload"], last["old"], last["after"], info


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_shape_dtype_zeros(backend, name, options):
    scheme = make_scheme(name, **options)
    ops = one_rank_ops(backend)
    for shape in SHAPES:
        for dtype in DTYPES:
            x = _tensor(backend, _values(shape, 1), dtype)
            out, payload, _, _, _ = _roundtrip(backend, _for(scheme, shape), x)
            assert tuple(ops.shape(out)) == shape, (name, shape, dtype)
            assert ops.dtype(out) == dtype, (name, shape, dtype)
        zeros = _tensor(backend, _values(shape, 1) * 0.0, "float32")
        out, _, _, _, _ = _roundtrip(backend, _for(scheme, shape), zeros, steps=2)
        assert (_to_numpy(out) == 0).all(), (name, shape)


def _gradient_basis(backend, scheme, state, x):
    """A state's residual as a flat float64 vector in the gradient's coordinates
    (``composite.residual_of``: THC keeps it rotated and padded)."""
    ops = one_rank_ops(backend)
    info = TensorInfo("t", ops.shape(x), "float32", 1, 0)
    return _to_numpy(composite.residual_of(scheme, ops, state, info)).reshape(-1).astype(np.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_error_feedback_identity(backend, name, options):
    """(grad + decay * old residual) == locally decoded + new residual, checked in float64."""
    import numpy as np
    scheme = make_scheme(name, **options)
    for shape in [(7,), (64, 48), (8, 4, 3, 3), (5000,)]:
        x = _tensor(backend, _values(shape, 2), "float32")
        routed = _for(scheme, shape)
        out, _, old, new, _ = _roundtrip(backend, routed, x, steps=3)
        if "residual" not in getattr(new, "_fields", ()) or _to_numpy(new.residual).size == 0:
            continue
        # decayed error feedback (SparseLoCo's decay, TopKC's residual_decay): x + b e
        decay = getattr(routed.config, "decay", getattr(routed.config, "residual_decay", 1.0))
        corrected = _to_numpy(x).reshape(-1) + decay * _gradient_basis(backend, routed, old, x)
        rebuilt = _to_numpy(out).reshape(-1) + _gradient_basis(backend, routed, new, x)
        np.testing.assert_allclose(rebuilt, corrected, rtol=1e-5, atol=1e-5 * np.abs(corrected).max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_payload_size_is_static_and_reported(backend, name, options):
    """Payload size is a function of (shape, dtype, config, world size), and wire() says it."""
    scheme = make_scheme(name, **options)
    ops = one_rank_ops(backend)
    for shape in [(7,), (64, 48), (5000,)]:
        routed, sizes = _for(scheme, shape), set()
        for seed, scale in [(3, 1.0), (4, 1e-6), (5, 1e4)]:
            x = _tensor(backend, _values(shape, seed) * scale, "float32")
            # auto's first step is its sync step (float32, not the wire): its second is plain
            _, payload, _, _, info = _roundtrip(backend, routed, x, steps=2 if routed.adaptive else 1)
            numel = 1
            for s in ops.shape(payload):
                numel *= s
            sizes.add(numel * itemsize(ops.dtype(payload)))
        assert len(sizes) == 1, (name, shape, sizes)
        assert routed.wire(info).payload == sizes.pop(), (name, shape)


def test_fp16_prescale_keeps_8_rank_sums_in_range():
    """Scheme-level: a value of 3e4 on each of 8 ranks survives (the multi-rank run is in parallel/)."""
    import numpy as np
    scheme = make_scheme("fp16")
    ops = one_rank_ops(BACKENDS[0])
    x = _tensor(BACKENDS[0], np.full((16,), 3.0e4), "float32")
    info = TensorInfo("t", (16,), "float32", 8, 0)
    state = scheme.init(ops, info, x)
    payload, ctx = compress_tensor(scheme, ops, x, state, info)
    summed = payload * 8  # what an 8-rank Sum all-reduce of identical payloads gives
    out, after = finish_tensor(scheme, ops, summed, ctx, state, info)
    np.testing.assert_allclose(_to_numpy(out), 8 * 3.0e4, rtol=1e-3)
    # From 8 ranks on fp16 keeps an agreed scale (cast.py, step 5): the first step used 1/8;
    # the next is 2**floor(log2(65504 / (2**10 * 8 * R))), R = the sum's peak 2.4e5 taken 8x
    # (the op is unknown: it may have been an Average) -> 2**-18.
    assert float(_to_numpy(after.fp16_scale)) == 2.0 ** -18


def _state_arrays(state):
    return [_to_numpy(v) for v in state]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_failed_step_leaves_every_rank_state_as_it_was(backend, name, options):
    """Two ranks simulated in one process (the all-reduce is the Sum of their payloads).

    After a normal step, rank 1's gradient holds an inf and rank 0's is finite: both ranks'
    outputs are non-finite, and both ranks' states after ``finish`` equal their states before
    the step, bit for bit (rank 0 learns of the failure only from the all-reduced payload).
    """
    import numpy as np
    scheme = make_scheme(name, **options)
    ops = one_rank_ops(backend)
    shape = (64, 48)
    xs = [_tensor(backend, _values(shape, 10 + r), "float32") for r in range(2)]
    infos = [TensorInfo("t", shape, "float32", 2, r, "sum") for r in range(2)]
    states = [scheme.init(ops, infos[r], xs[r]) for r in range(2)]

    def step(grads):
        sent = [compress_tensor(scheme, ops, grads[r], states[r], infos[r]) for r in range(2)]
        reduced = sent[0][0] + sent[1][0]
        return [finish_tensor(scheme, ops, reduced, sent[r][1], states[r], infos[r]) for r in range(2)]

    states = [after for _, after in step(xs)]
    bad = _values(shape, 12)
    bad[3, 5] = np.inf
    results = step([_tensor(backend, _values(shape, 11), "float32"), _tensor(backend, bad, "float32")])
    for r, (out, after) in enumerate(results):
        assert not np.isfinite(_to_numpy(out)).all(), (name, r)
        assert type(after) is type(states[r]) and len(after) == len(states[r])
        for field, a, b in zip(after._fields, _state_arrays(after), _state_arrays(states[r])):
            if scheme.adaptive and field == "step":  # auto's schedule counts calls (base.py)
                assert a == b + 1
                continue
            np.testing.assert_array_equal(a, b, err_msg=f"{name} rank {r} state field {field}")


def test_scheme_flags():
    """Which schemes Horovod may Min/Max/Adasum/scale (linear casts) and which it may not."""
    for name in ("fp16", "bf16"):
        s = make_scheme(name)
        assert s.linear and s.scalable and not s.identity and not s.blocking, name
    assert make_scheme("none").identity and not make_scheme("none").linear
    cast = make_scheme("none", dtype="float32")  # a float32 cast: linear, not untouched
    assert cast.linear and cast.scalable and not cast.identity and not cast.guards_nonfinite
    info = TensorInfo("t", (3, 5), "bfloat16", 2, 0)
    assert (cast.wire(info).payload, composite.payload_dtype(cast, info)) == (60, "float32")
    assert (make_scheme("none").wire(info).payload, composite.payload_dtype(make_scheme("none"), info)) == \
        (30, "bfloat16")
    for name in ("topk", "topkc"):
        s = make_scheme(name)
        assert not s.linear and not s.identity and s.scalable and not s.blocking, name
    assert make_scheme("topkc", selection="current").blocking


class _Flat(NamedTuple):
    residual: object


@pytest.mark.parametrize("backend", BACKENDS)
def test_composite_residual_defaults(backend):
    """The defaults of hvd_gradcomp.composite for a scheme without hooks (topk): residual_of
    is the state's ``residual`` field flattened, add_residual adds in that order and keeps the
    field's shape; a state without a (non-empty) residual gives None for both."""
    ops = one_rank_ops(backend)
    scheme = make_scheme("topk")
    info = TensorInfo("t", (4, 6), "float32", 1, 0)
    values = _values((4, 6), 20)
    extra = _values((24,), 21)
    state = _Flat(_tensor(backend, values, "float32"))
    np.testing.assert_array_equal(_to_numpy(composite.residual_of(scheme, ops, state, info)),
                                  _to_numpy(_tensor(backend, values.reshape(-1), "float32")))
    added = composite.add_residual(scheme, ops, state, info, _tensor(backend, extra, "float32"))
    assert type(added) is _Flat and tuple(ops.shape(added.residual)) == (4, 6)
    want = _to_numpy(_tensor(backend, values, "float32")) + \
        _to_numpy(_tensor(backend, extra, "float32")).reshape(4, 6)
    np.testing.assert_allclose(_to_numpy(added.residual), want, rtol=1e-6)
    for keeps_none in (EmptyState(), _Flat(_tensor(backend, np.zeros(0), "float32"))):
        assert composite.residual_of(scheme, ops, keeps_none, info) is None
        assert composite.add_residual(scheme, ops, keeps_none, info, _tensor(backend, extra, "float32")) is None
    with pytest.raises(NotImplementedError, match="topk: residual of 5 values for a tensor of 24; "
                                                  "override residual_of"):
        composite.residual_of(scheme, ops, _Flat(_tensor(backend, np.zeros(5), "float32")), info)
    # an override is used: EF21 keeps no residual; THC's is rotated and padded (1024 values)
    ef21 = make_scheme("topkc", error_feedback="ef21")
    assert composite.residual_of(ef21, ops, ef21.init(ops, info, state.residual), info) is None
    thc = make_scheme("thc").bind(ops)
    got = composite.residual_of(thc, ops, thc.init(ops, info, state.residual), info)
    np.testing.assert_array_equal(_to_numpy(got), np.zeros(24))


@pytest.mark.parametrize("backend", BACKENDS)
def test_composite_other_defaults(backend):
    """payload_dtype, hand_over, init_like, forget, check_loaded, metrics and blocks: their
    defaults, and the schemes' overrides where they have one."""
    ops = one_rank_ops(backend)
    info = TensorInfo("t", (64, 48), "float32", 1, 0)
    like = _tensor(backend, np.zeros(1), "float32")
    topk = make_scheme("topk")
    state = topk.init(ops, info, like)
    assert composite.payload_dtype(topk, info) == "float32"
    assert composite.payload_dtype(make_scheme("fp16"), info) == "float16"
    assert composite.payload_dtype(make_scheme("thc"), info) == "int32"
    own = _tensor(backend, _values((64 * 48,), 22), "float32")
    assert composite.hand_over(topk, ops, state, own, own, info) is state
    fresh = composite.init_like(topk, ops, info, like, state)
    assert fresh._fields == ("residual",) and (_to_numpy(fresh.residual) == 0).all()
    assert tuple(ops.shape(fresh.residual)) == (64 * 48,)
    assert composite.forget(topk, "t") is None and composite.check_loaded(topk, "t", state) is None
    assert composite.metrics(topk, state) == {}
    topkc = make_scheme("topkc")
    assert set(composite.metrics(topkc, topkc.init(ops, info, like))) == {"realigned"}
    with pytest.raises(ValueError, match="PowerSGD state format 7"):
        composite.check_loaded(make_scheme("powersgd"), "t",
                               {f: np.int64(7) for f in PowerSGDState._fields})
    assert composite.blocks(make_scheme("topkc", selection="current"), info)
    assert not composite.blocks(topkc, info) and not composite.blocks(topk, info)


def test_scheme_shows_the_lifecycle_only():
    """Scheme defines none of the composite hooks: a scheme author sees init, compress,
    receive, decompress, finish, wire (and bind, spec, the flags)."""
    for hook in composite.__all__:
        assert not hasattr(Scheme, hook), hook
    for method in ("init", "compress", "receive", "decompress", "finish", "wire", "bind", "spec"):
        assert callable(getattr(Scheme, method)), method
