"""FrozenVarianceAdamW (torch_backend.optim, tf_backend.optim), one process.

Values against a float64 reference recursion written here (AdamW, then the second moment and
its bias correction frozen after freeze_step, refreshed at freeze_step + R * (2^j - 1));
PyTorch and Keras against each other on the same gradients; exactly torch.optim.AdamW before
the freeze; linear in the gradient after it; state_dict / checkpoint / get_config round
trips; argument errors.
"""
import copy
import io

import numpy as np
import pytest

from tests.conftest import requires_backend

LR, BETAS, EPS, WD = 0.05, (0.9, 0.99), 1e-8, 0.1


def refresh_steps(freeze, interval, last):
    """Steps after the freeze at which v takes one more gradient: gaps R, 2R, 4R, ..."""
    out, t, gap = set(), freeze, interval
    while interval and t + gap <= last:
        t += gap
        out.add(t)
        gap *= 2
    return out


def reference(p0, grads, lr=LR, betas=BETAS, eps=EPS, wd=WD, freeze=4, interval=0):
    """float64 frozen-variance AdamW: the parameter after each step."""
    b1, b2 = betas
    p = np.asarray(p0, np.float64).copy()
    m, v, k = np.zeros_like(p), np.zeros_like(p), 0
    extra = refresh_steps(freeze, interval, len(grads))
    out = []
    for t, g in enumerate(grads, 1):
        g = np.asarray(g, np.float64)
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        if t <= freeze or t in extra:
            v = b2 * v + (1 - b2) * g * g
            k += 1
        p = p - lr / (1 - b1 ** t) * m / (np.sqrt(v / (1 - b2 ** k)) + eps)
        out.append(p.copy())
    return out


def gradients(steps, shape, seed):
    rng = np.random.default_rng(seed)
    # Growing scale: v keeps changing, so a missed or extra update of it shows.
    return [(rng.standard_normal(shape) * (1 + 0.5 * s)).astype(np.float32) for s in range(steps)]


CASES = [dict(freeze=4, interval=0), dict(freeze=3, interval=2), dict(freeze=1, interval=1),
         dict(freeze=50, interval=0)]


# ---------------------------------------------------------------- PyTorch
def torch_run(p0, grads, **kw):
    import torch
    from torch_backend import FrozenVarianceAdamW
    p = torch.nn.Parameter(torch.tensor(p0))
    opt = FrozenVarianceAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=kw["freeze"],
                              refresh_interval=kw["interval"])
    out = []
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
        out.append(p.detach().numpy().copy())
    return out, opt, p


@requires_backend("torch")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_torch_matches_float64_reference(case):
    p0 = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    grads = gradients(16, (3, 4), 2)
    got, opt, p = torch_run(p0, grads, **case)
    for t, (a, b) in enumerate(zip(got, reference(p0, grads, **case)), 1):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=f"step {t}")
    assert opt.state[p]["v_step"] == min(16, case["freeze"]) + len(refresh_steps(case["freeze"], case["interval"], 16))
    assert opt.frozen(p) == (16 >= case["freeze"])


@requires_backend("torch")
def test_torch_freeze_changes_the_result():
    # The reference without the freeze (freeze beyond the run) ends elsewhere: the test above
    # can tell frozen from plain AdamW.
    p0 = np.zeros(6, np.float32)
    grads = gradients(12, (6,), 3)
    frozen, plain = reference(p0, grads, freeze=3)[-1], reference(p0, grads, freeze=100)[-1]
    assert np.abs(frozen - plain).max() > 1e-2


@requires_backend("torch")
def test_torch_equals_adamw_before_the_freeze_per_group():
    import torch
    from torch_backend import FrozenVarianceAdamW
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(7)), torch.nn.Parameter(torch.randn(2, 3))
    a2, b2 = (torch.nn.Parameter(x.detach().clone()) for x in (a, b))
    ours = FrozenVarianceAdamW([{"params": [a], "freeze_step": 3}, {"params": [b], "freeze_step": 6, "lr": 0.02}],
                               lr=0.1, weight_decay=0.05)
    plain = torch.optim.AdamW([{"params": [a2]}, {"params": [b2], "lr": 0.02}], lr=0.1, weight_decay=0.05,
                              foreach=False)
    same = []
    for _ in range(8):
        ga, gb = torch.randn(7), torch.randn(2, 3) * 3
        a.grad, a2.grad, b.grad, b2.grad = ga, ga.clone(), gb, gb.clone()
        ours.step()
        plain.step()
        same.append((torch.equal(a, a2), torch.equal(b, b2)))
    # Bit for bit AdamW up to each group's freeze_step, then not.
    assert same == [(s <= 3, s <= 6) for s in range(1, 9)]
    assert [g["freeze_step"] for g in ours.param_groups] == [3, 6]


@requires_backend("torch")
def test_torch_step_is_linear_in_the_gradient_once_frozen():
    import torch
    from torch_backend import FrozenVarianceAdamW
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(10, dtype=torch.float64))
    opt = FrozenVarianceAdamW([p], lr=0.1, freeze_step=3)
    for _ in range(5):
        p.grad = torch.randn(10, dtype=torch.float64)
        opt.step()
    saved_p, saved = p.detach().clone(), copy.deepcopy(opt.state_dict())

    def delta(g):
        with torch.no_grad():
            p.copy_(saved_p)
        opt.load_state_dict(copy.deepcopy(saved))  # state_dict() holds the live tensors
        p.grad = g
        opt.step()
        return p.detach() - saved_p

    g1, g2 = torch.randn(10, dtype=torch.float64), 5 * torch.randn(10, dtype=torch.float64)
    zero = delta(torch.zeros(10, dtype=torch.float64))
    torch.testing.assert_close(delta(g1 + g2) - zero, (delta(g1) - zero) + (delta(g2) - zero), rtol=1e-12, atol=1e-14)
    assert (delta(g2) - zero).abs().max() > 1e-3


@requires_backend("torch")
def test_torch_state_dict_round_trip_continues_exactly():
    import torch
    from torch_backend import FrozenVarianceAdamW
    p0 = np.random.default_rng(4).standard_normal(9).astype(np.float32)
    grads = gradients(12, (9,), 5)
    straight, _, _ = torch_run(p0, grads, freeze=3, interval=2)
    first, opt, p = torch_run(p0, grads[:5], freeze=3, interval=2)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "p": p.detach()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    q = torch.nn.Parameter(ckpt["p"].clone())
    resumed = FrozenVarianceAdamW([q])  # options come back from the checkpoint's groups
    resumed.load_state_dict(ckpt["opt"])
    group = resumed.param_groups[0]
    assert (group["freeze_step"], group["refresh_interval"], group["lr"], group["betas"]) == (3, 2, LR, BETAS)
    state = resumed.state[q]
    assert float(state["step"]) == 5 and state["v_step"] == 4 and resumed.frozen(q)
    assert state["step"].device.type == "cpu" and state["exp_avg_sq"].dtype == torch.float32
    for g in grads[5:]:
        q.grad = torch.tensor(g)
        resumed.step()
    np.testing.assert_array_equal(q.detach().numpy(), straight[-1])


@requires_backend("torch")
def test_torch_loads_a_plain_adamw_checkpoint():
    import torch
    from torch_backend import FrozenVarianceAdamW
    p0 = np.random.default_rng(6).standard_normal(5).astype(np.float32)
    grads = gradients(9, (5,), 7)
    p = torch.nn.Parameter(torch.tensor(p0))
    plain = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for g in grads[:2]:
        p.grad = torch.tensor(g)
        plain.step()
    ours = FrozenVarianceAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=4)
    ours.load_state_dict(plain.state_dict())
    assert ours.param_groups[0]["freeze_step"] == 4  # filled from the defaults
    for g in grads[2:]:
        p.grad = torch.tensor(g)
        ours.step()
    np.testing.assert_allclose(p.detach().numpy(), reference(p0, grads, freeze=4)[-1], rtol=2e-5, atol=2e-6)
    assert ours.state[p]["v_step"] == 4


@requires_backend("torch")
@pytest.mark.parametrize("kwargs, message", [
    (dict(freeze_step=0), "freeze_step must be an int >= 1, got 0"),
    (dict(freeze_step=2.5), "freeze_step must be an int >= 1, got 2.5"),
    (dict(freeze_step=True), "freeze_step must be an int >= 1, got True"),
    (dict(refresh_interval=-1), "refresh_interval must be an int >= 0, got -1"),
    (dict(lr=-0.1), "lr must be >= 0.0, got -0.1"),
    (dict(betas=(0.9, 1.0)), r"betas\[1\] must be >= 0.0 and < 1.0, got 1.0"),
    (dict(betas=(0.9,)), r"betas must be a pair of floats, got \(0.9,\)"),
    (dict(eps=float("nan")), "eps must be a finite float, got nan"),
    (dict(weight_decay=-1e-3), "weight_decay must be >= 0.0, got -0.001"),
    (dict(foreach=True), "foreach=True is not supported"),
])
def test_torch_argument_errors(kwargs, message):
    import torch
    from torch_backend import FrozenVarianceAdamW
    with pytest.raises(ValueError, match=f"^FrozenVarianceAdamW: {message}"):
        FrozenVarianceAdamW([torch.nn.Parameter(torch.zeros(3))], **kwargs)


@requires_backend("torch")
def test_torch_group_and_parameter_errors():
    import torch
    from torch_backend import FrozenVarianceAdamW
    opt = FrozenVarianceAdamW([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="^FrozenVarianceAdamW: freeze_step must be an int >= 1, got -5$"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "freeze_step": -5})
    with pytest.raises(ValueError, match="^FrozenVarianceAdamW: parameter 0 of a group has dtype torch.complex64"):
        FrozenVarianceAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    dense, sparse = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = FrozenVarianceAdamW([dense, sparse])
    dense.grad = torch.ones(4)
    sparse.grad = torch.ones(4).to_sparse()
    with pytest.raises(ValueError, match="^FrozenVarianceAdamW: parameter 1 has a sparse gradient"):
        opt.step()
    assert torch.equal(dense.detach(), torch.ones(4)) and not opt.state  # nothing moved
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        opt.frozen(torch.zeros(1))


@requires_backend("torch")
def test_torch_on_cuda_without_host_syncs():
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from torch_backend import FrozenVarianceAdamW
    p0 = np.random.default_rng(8).standard_normal(64).astype(np.float32)
    grads = gradients(10, (64,), 9)
    p = torch.nn.Parameter(torch.tensor(p0, device="cuda"))
    opt = FrozenVarianceAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=3, refresh_interval=2)
    dev_grads = [torch.tensor(g, device="cuda") for g in grads]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for g in dev_grads:
            p.grad = g
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.state[p]["exp_avg"].device.type == "cuda"
    np.testing.assert_allclose(p.detach().cpu().numpy(), reference(p0, grads, freeze=3, interval=2)[-1],
                               rtol=2e-5, atol=2e-6)


# ---------------------------------------------------------------- Keras
def keras_run(p0, grads, jit_compile=False, **kw):
    import tensorflow as tf
    from tf_backend import FrozenVarianceAdamW
    var = tf.Variable(p0)
    opt = FrozenVarianceAdamW(learning_rate=LR, beta_1=BETAS[0], beta_2=BETAS[1], epsilon=EPS, weight_decay=WD,
                              freeze_step=kw["freeze"], refresh_interval=kw["interval"], jit_compile=jit_compile)
    out = []
    for g in grads:
        opt.apply_gradients([(tf.constant(g), var)])
        out.append(var.numpy().copy())
    return out, opt, var


@requires_backend("tensorflow")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_keras_matches_float64_reference_and_torch(case):
    p0 = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    grads = gradients(16, (3, 4), 2)
    ref = reference(p0, grads, **case)
    for jit in (False, True):
        got, _, _ = keras_run(p0, grads, jit_compile=jit, **case)
        for t, (a, b) in enumerate(zip(got, ref), 1):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=f"jit {jit} step {t}")
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    torch_got, _, _ = torch_run(p0, grads, **case)
    for a, b in zip(got, torch_got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@requires_backend("tensorflow")
def test_keras_indexed_slices_are_dense_updates():
    import tensorflow as tf
    from tf_backend import FrozenVarianceAdamW
    p0 = np.ones((4, 2), np.float32)
    grads = gradients(5, (4, 2), 10)
    var = tf.Variable(p0)
    opt = FrozenVarianceAdamW(learning_rate=LR, beta_1=BETAS[0], beta_2=BETAS[1], weight_decay=WD, freeze_step=2)
    for g in grads:
        rows = tf.IndexedSlices(tf.constant(g[[0, 2]]), tf.constant([0, 2]), tf.constant([4, 2]))
        opt.apply_gradients([(rows, var)])
    dense = [g * np.array([[1], [0], [1], [0]], np.float32) for g in grads]
    np.testing.assert_allclose(var.numpy(), reference(p0, dense, freeze=2)[-1], rtol=2e-5, atol=2e-6)


@requires_backend("tensorflow")
def test_keras_config_and_checkpoint_round_trip(tmp_path):
    import tensorflow as tf
    from tf_backend import FrozenVarianceAdamW
    p0 = np.random.default_rng(4).standard_normal(9).astype(np.float32)
    grads = gradients(12, (9,), 5)
    straight, opt, _ = keras_run(p0, grads, freeze=3, interval=2)
    config = opt.get_config()
    assert (config["freeze_step"], config["refresh_interval"], config["epsilon"]) == (3, 2, EPS)
    again = FrozenVarianceAdamW.from_config(config)
    assert type(again) is FrozenVarianceAdamW and again.get_config() == config
    assert isinstance(again, tf.keras.optimizers.AdamW)

    first, opt, var = keras_run(p0, grads[:5], freeze=3, interval=2)
    path = tf.train.Checkpoint(optimizer=opt, var=var).save(str(tmp_path / "ckpt"))
    var2 = tf.Variable(np.zeros_like(p0))
    opt2 = FrozenVarianceAdamW.from_config(opt.get_config())
    opt2.build([var2])
    tf.train.Checkpoint(optimizer=opt2, var=var2).restore(path).assert_consumed()
    assert int(opt2.iterations) == 5
    for g in grads[5:]:
        opt2.apply_gradients([(tf.constant(g), var2)])
    np.testing.assert_array_equal(var2.numpy(), straight[-1])


@requires_backend("tensorflow")
@pytest.mark.parametrize("kwargs, message", [
    (dict(freeze_step=0), "freeze_step must be an int >= 1, got 0"),
    (dict(freeze_step="10"), "freeze_step must be an int >= 1, got '10'"),
    (dict(refresh_interval=1.5), "refresh_interval must be an int >= 0, got 1.5"),
    (dict(learning_rate=-1.0), "learning_rate must be >= 0.0, got -1.0"),
    (dict(beta_2=1.0), "beta_2 must be >= 0.0 and < 1.0, got 1.0"),
    (dict(beta_1=-0.1), "beta_1 must be >= 0.0 and < 1.0, got -0.1"),
    (dict(epsilon=float("inf")), "epsilon must be a finite float, got inf"),
    (dict(weight_decay=None), "weight_decay must be a finite float, got None"),
    (dict(amsgrad=True), "amsgrad=True is not supported"),
])
def test_keras_argument_errors(kwargs, message):
    from tf_backend import FrozenVarianceAdamW
    with pytest.raises(ValueError, match=f"^FrozenVarianceAdamW: {message}"):
        FrozenVarianceAdamW(**kwargs)


@requires_backend("torch")
def test_bench_worker_optimizer_flag():
    import argparse

    import torch
    from hvd_gradcomp.bench.workers.digits_torch import add_optimizer_args, optimizer_factory
    from torch_backend import FrozenVarianceAdamW
    parser = argparse.ArgumentParser()
    add_optimizer_args(parser)
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert optimizer_factory(parser.parse_args([])) is None  # the workload's own optimizer
    opt = optimizer_factory(parser.parse_args(["--optimizer", "frozen_adamw", "--freeze-step", "7"]))(params, 0.01)
    assert type(opt) is FrozenVarianceAdamW
    assert {k: opt.param_groups[0][k] for k in ("lr", "weight_decay", "freeze_step")} == \
        {"lr": 0.01, "weight_decay": 0.0, "freeze_step": 7}
    opt = optimizer_factory(parser.parse_args(["--optimizer", "adamw", "--weight-decay", "0.1"]))(params, 0.02)
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["weight_decay"] == 0.1
    with pytest.raises(SystemExit):
        parser.parse_args(["--optimizer", "sgd"])
