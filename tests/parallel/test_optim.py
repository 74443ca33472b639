"""FrozenVarianceAdamW under real Horovod (2 ranks, Gloo), wrapped by ``hvd.DistributedOptimizer``
or fed by ``hvd.DistributedGradientTape``: one PyTorch and one TensorFlow launch.

Workload: a 16-32-4 MLP regression, each rank its own 64 samples, identical initial weights,
12 steps, freeze_step 4, refresh_interval 3 (v refreshed at step 7). The recipe of
docs/optimizers.md: FP16 during the warm-up, TopKC (ratio 0.1, chunk 8, every tensor) from the
freeze on. TopKC during the warm-up would leave ``v`` zero where no chunk was sent yet, and the
frozen step there ``lr * m / eps``. PyTorch switches with ``Phased`` below (on the loop's word);
TensorFlow's tape takes the phase's compressor each step (Horovod caches its all-reduce
function per compressor, so one object per phase).

PyTorch (``worker_torch``): each step synchronizes, records the delivered (decompressed,
averaged) gradients, then steps under ``skip_synchronize``; the tests replay the float64
reference recursion of tests/core/test_optim.py on those gradients and compare every
parameter after every step. Also: the wrapped optimizer keeps its class and options, the
delivered gradients are really sparse, the ranks agree, and ``hvd.broadcast_optimizer_state``
carries the state (``v_step`` included) from rank 0 to a rank whose state was altered.

TensorFlow (``worker_tf``): ``hvd.DistributedGradientTape`` + ``apply_gradients`` (delivered
gradients recorded and replayed as above), and ``horovod.tensorflow.keras.DistributedOptimizer``
(rebuilt by Horovod from ``get_config``) with FP16 through ``minimize`` (replayed on the same
all-reduce done beside it) and ``model.fit``.
"""
import numpy as np
import pytest

from tests.conftest import requires_backend
from tests.core.test_optim import reference
from tests.hvdrun import run

STEPS, FREEZE, REFRESH = 12, 4, 3
LR, BETAS, EPS, WD = 0.01, (0.9, 0.99), 1e-8, 0.05
SPEC = "topkc:ratio=0.1,chunk=8,min_numel=1"


class Phased:
    """A Horovod compressor: ``warm`` (FP16) while ``dense`` is set, then ``then`` (TopKC)."""

    def __init__(self, warm, then):
        self.warm, self.then, self.dense = warm, then, True

    def compress(self, tensor, name=None):
        comp = self.warm if self.dense else self.then
        payload, ctx = comp.compress(tensor, name=name)
        return payload, (comp, ctx)

    def decompress(self, payload, ctx):
        comp, inner = ctx
        return comp.decompress(payload, inner)


def _data(rank):
    rng = np.random.default_rng([7, rank])
    x = rng.standard_normal((64, 16)).astype(np.float32)
    y = np.tanh(x[:, :4] * (1 + rank)).astype(np.float32)
    return x, y


def _init():
    rng = np.random.default_rng(11)
    return [(rng.standard_normal((32, 16)) * 0.3).astype(np.float32), np.zeros(32, np.float32),
            (rng.standard_normal((4, 32)) * 0.3).astype(np.float32), np.zeros(4, np.float32)]


def worker_torch():
    import horovod.torch as hvd
    import torch
    from torch_backend import Compression, FrozenVarianceAdamW
    hvd.init()
    torch.set_num_threads(1)
    x, y = (torch.tensor(a) for a in _data(hvd.rank()))
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p, w in zip(net.parameters(), _init()):
            p.copy_(torch.tensor(w))
    base = FrozenVarianceAdamW(net.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                               freeze_step=FREEZE, refresh_interval=REFRESH)
    comp = Phased(Compression.fp16(), Compression.from_spec(SPEC))
    opt = hvd.DistributedOptimizer(base, named_parameters=net.named_parameters(), compression=comp)
    out = {"is_ours": isinstance(opt, FrozenVarianceAdamW) and isinstance(opt, torch.optim.AdamW),
           "options": {k: opt.param_groups[0][k] for k in ("lr", "betas", "weight_decay", "freeze_step",
                                                           "refresh_interval")},
           "delivered": [], "params": [], "losses": []}
    for step in range(STEPS):
        comp.dense = step < FREEZE
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.synchronize()
        out["delivered"].append([p.grad.detach().numpy().copy() for p in net.parameters()])
        with opt.skip_synchronize():
            opt.step()
        out["params"].append([p.detach().numpy().copy() for p in net.parameters()])
        out["losses"].append(float(loss))
    out["frozen"] = [opt.frozen(p) for p in net.parameters()]
    out["v_step"] = [opt.state[p]["v_step"] for p in net.parameters()]
    # broadcast_optimizer_state: rank 1's state and options altered, then rank 0's restored.
    if hvd.rank() == 1:
        for p in net.parameters():
            opt.state[p]["v_step"] += 7
            opt.state[p]["exp_avg_sq"].mul_(3.0)
            opt.state[p]["step"].add_(5)
        opt.param_groups[0]["freeze_step"] = 99
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["after_broadcast"] = {"v_step": [opt.state[p]["v_step"] for p in net.parameters()],
                              "step": [float(opt.state[p]["step"]) for p in net.parameters()],
                              "exp_avg_sq": [opt.state[p]["exp_avg_sq"].numpy().copy() for p in net.parameters()],
                              "freeze_step": opt.param_groups[0]["freeze_step"]}
    return out


def worker_tf():
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    import tensorflow as tf
    from tf_backend import Compression, FrozenVarianceAdamW
    hvd.init()
    x, y = _data(hvd.rank())
    kw = dict(learning_rate=LR, beta_1=BETAS[0], beta_2=BETAS[1], epsilon=EPS, weight_decay=WD,
              freeze_step=FREEZE, refresh_interval=REFRESH)

    def model():
        m = tf.keras.Sequential([tf.keras.layers.Dense(32, activation="tanh", input_shape=(16,)),
                                 tf.keras.layers.Dense(4)])
        m.set_weights([w.T if w.ndim == 2 else w for w in _init()])  # Keras kernels are (in, out)
        return m

    def loss_fn(m):
        return tf.reduce_mean(tf.square(m(x) - y))

    out = {"delivered": [], "params": []}
    # 1. DistributedGradientTape + apply_gradients.
    m1, opt1 = model(), FrozenVarianceAdamW(**kw)
    # Horovod caches the tape's all-reduce function per compressor: one object per phase.
    warm, then = Compression.fp16(), Compression.from_spec(SPEC)
    for step in range(STEPS):
        with tf.GradientTape() as tape:
            loss = loss_fn(m1)
        tape = hvd.DistributedGradientTape(tape, compression=warm if step < FREEZE else then)
        grads = tape.gradient(loss, m1.trainable_variables)
        out["delivered"].append([g.numpy().copy() for g in grads])
        opt1.apply_gradients(zip(grads, m1.trainable_variables))
        out["params"].append([v.numpy().copy() for v in m1.trainable_variables])
    # 2. horovod.tensorflow.keras.DistributedOptimizer (rebuilt from get_config) via minimize,
    # FP16 throughout (its all-reduce is one tf.function, traced once: no phase switch). The
    # delivered gradients: this rank's, all-reduced the same way beside it.
    m2 = model()
    opt2 = hvd_keras.DistributedOptimizer(FrozenVarianceAdamW(**kw), compression=Compression.fp16())
    out["keras_class"] = (isinstance(opt2, FrozenVarianceAdamW), opt2.freeze_step, opt2.refresh_interval,
                          float(opt2.epsilon), float(opt2.weight_decay))
    out["minimize"] = {"delivered": [], "params": []}
    for step in range(STEPS):
        with tf.GradientTape() as local:
            loss = loss_fn(m2)
        side = Compression.fp16()
        out["minimize"]["delivered"].append([
            hvd.allreduce(g, op=hvd.Average, name=f"side.{step}.{j}", compression=side).numpy()
            for j, g in enumerate(local.gradient(loss, m2.trainable_variables))])
        tape = tf.GradientTape()
        with tape:
            loss = loss_fn(m2)
        opt2.minimize(loss, m2.trainable_variables, tape=tape)
        out["minimize"]["params"].append([v.numpy().copy() for v in m2.trainable_variables])
    out["minimize_iterations"] = int(opt2.iterations)
    # 3. model.fit with the wrapped optimizer.
    m3 = model()
    opt3 = hvd_keras.DistributedOptimizer(FrozenVarianceAdamW(**kw), compression=Compression.fp16())
    m3.compile(opt3, "mse")
    hist = m3.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    out["fit"] = {"loss": hist.history["loss"], "weights": [w.copy() for w in m3.get_weights()],
                  "iterations": int(opt3.iterations)}
    return out


def _replay(result):
    """The float64 reference on each parameter's delivered gradients, step by step."""
    init = _init()
    per_param = list(zip(*result["delivered"]))
    return [reference(w0, grads, lr=LR, betas=BETAS, eps=EPS, wd=WD, freeze=FREEZE, interval=REFRESH)
            for w0, grads in zip(init, per_param)]


def _check_against_replay(result, transpose):
    refs = _replay({"delivered": [[g.T if transpose and g.ndim == 2 else g for g in step]
                                  for step in result["delivered"]]})
    for t in range(STEPS):
        for j, ref in enumerate(refs):
            got = result["params"][t][j]
            got = got.T if transpose and got.ndim == 2 else got
            np.testing.assert_allclose(got, ref[t], rtol=2e-5, atol=2e-6, err_msg=f"step {t + 1} param {j}")


def _check_sparse_delivery(result):
    # TopKC at ratio 0.1 delivers about 10% of each tensor's chunks per step (both ranks'
    # choices united): most coordinates of the 32x16 weight's delivered gradient are zero
    # after the warm-up, none during it (FP16).
    zeros = [np.mean(step[0] == 0) for step in result["delivered"]]
    assert max(zeros[:FREEZE]) == 0 and min(zeros[FREEZE:]) > 0.6, zeros


@pytest.fixture(scope="module")
def results_torch():
    return run(worker_torch, np=2, timeout=300)


@pytest.fixture(scope="module")
def results_tf():
    return run(worker_tf, np=2, timeout=420)


@requires_backend("torch")
def test_torch_wrapped_keeps_class_and_options(results_torch):
    for r in results_torch:
        assert r["is_ours"]
        assert r["options"] == {"lr": LR, "betas": BETAS, "weight_decay": WD, "freeze_step": FREEZE,
                                "refresh_interval": REFRESH}
        assert r["frozen"] == [True] * 4
        assert r["v_step"] == [FREEZE + 1] * 4  # refreshed at step 7 (13 is past the run)


@requires_backend("torch")
def test_torch_topkc_training_matches_reference(results_torch):
    for r in results_torch:
        _check_sparse_delivery(r)
        _check_against_replay(r, transpose=False)
        assert r["losses"][-1] < 0.8 * r["losses"][0], r["losses"]
    for a, b in zip(results_torch[0]["params"][-1], results_torch[1]["params"][-1]):
        np.testing.assert_array_equal(a, b)


@requires_backend("torch")
def test_torch_broadcast_optimizer_state(results_torch):
    root, other = (r["after_broadcast"] for r in results_torch)
    assert root["v_step"] == other["v_step"] == [FREEZE + 1] * 4
    assert root["step"] == other["step"] == [float(STEPS)] * 4
    assert root["freeze_step"] == other["freeze_step"] == FREEZE
    for a, b in zip(root["exp_avg_sq"], other["exp_avg_sq"]):
        np.testing.assert_array_equal(a, b)


@requires_backend("tensorflow")
def test_tf_tape_training_matches_reference(results_tf):
    for r in results_tf:
        _check_sparse_delivery({"delivered": [[g.T if g.ndim == 2 else g for g in s] for s in r["delivered"]]})
        _check_against_replay(r, transpose=True)
    for a, b in zip(results_tf[0]["params"][-1], results_tf[1]["params"][-1]):
        np.testing.assert_array_equal(a, b)


@requires_backend("tensorflow")
def test_tf_keras_distributed_optimizer_matches_reference(results_tf):
    for r in results_tf:
        assert r["keras_class"] == (True, FREEZE, REFRESH, EPS, WD)
        assert r["minimize_iterations"] == STEPS
        _check_against_replay(r["minimize"], transpose=True)
    for a, b in zip(results_tf[0]["minimize"]["params"][-1], results_tf[1]["minimize"]["params"][-1]):
        np.testing.assert_array_equal(a, b)


@requires_backend("tensorflow")
def test_tf_keras_fit(results_tf):
    fits = [r["fit"] for r in results_tf]
    for f in fits:
        assert f["iterations"] == 12  # 3 epochs x 4 batches
        assert f["loss"][-1] < f["loss"][0], f["loss"]
    for a, b in zip(fits[0]["weights"], fits[1]["weights"]):
        np.testing.assert_array_equal(a, b)
