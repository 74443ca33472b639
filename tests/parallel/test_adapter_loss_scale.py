"""Error feedback under loss scaling (``set_loss_scale``), 2 real Horovod ranks (Gloo).

1. Residual units, PyTorch: ``topk:ratio=0.5``, every rank's gradient is ``S * [1, 0.5]`` at
   step 1 with scale S = 1024, then ``0`` at step 2 with S = 512. TopK sends the 1 and keeps
   0.5 in its residual; step 2 must deliver that 0.5 (unscaled), i.e. ``512 * [0, 0.5]`` as
   a scaled gradient. Without ``set_loss_scale`` the residual is kept in scaled units and is
   replayed at 1024/512 = 2x (``512 * [0, 1.0]``): the test checks both, so it can fail.
2. The same with TensorFlow, the scale in a ``tf.Variable`` read inside ``tf.function``.
3. Training, PyTorch AMP pattern (``scaler.scale(loss).backward(); opt.synchronize();
   scaler.unscale_(opt); with opt.skip_synchronize(): scaler.step(opt); scaler.update()``):
   the digits MLP for 200 steps with ``topkc`` and ``thc``, the scale starting at 2**16 and a
   forced backoff (rank 0's loss is multiplied by inf at step 50, so every rank's output is
   non-finite, every rank skips the step and halves the scale together). The final loss
   must stay within 10 % + 0.02 of the FP16 run without loss scaling, the ranks' weights
   identical, the scale halved exactly once more than in a run without the forced inf.
"""
import numpy as np

from tests.backends import requires_backend
from tests.hvdrun import run


def worker_torch_units():
    import horovod.torch as hvd
    import torch
    from torch_backend import Compression
    hvd.init()
    out = {}
    for use_scale in (True, False):
        comp = Compression.topk(ratio=0.5)
        scale = torch.tensor(1024.0)
        if use_scale:
            comp.set_loss_scale(scale)
        steps = []
        for s, g in ((1024.0, [1.0, 0.5]), (512.0, [0.0, 0.0])):
            scale.fill_(s)
            grad = torch.tensor(g) * s
            steps.append(hvd.allreduce(grad, name="g", op=hvd.Average, compression=comp).numpy().tolist())
        out[use_scale] = steps
    return out


@requires_backend("torch")
def test_residual_kept_in_unscaled_units_torch():
    results = run(worker_torch_units, np=2, timeout=120)
    for r in results:
        assert np.allclose(r[True][0], [1024.0, 0.0])
        assert np.allclose(r[True][1], [0.0, 512.0 * 0.5])
        assert np.allclose(r[False][1], [0.0, 512.0 * 1.0])  # the bug set_loss_scale fixes


def worker_tf_units():
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from tf_backend import Compression
    hvd.init()
    comp = Compression.topk(ratio=0.5)
    scale = tf.Variable(1024.0)
    comp.set_loss_scale(scale)

    @tf.function
    def step(g):
        return hvd.allreduce(g * scale, name="g", op=hvd.Average, compression=comp)

    outs = []
    for s, g in ((1024.0, [1.0, 0.5]), (512.0, [0.0, 0.0])):
        scale.assign(s)
        outs.append(step(tf.constant(g)).numpy().tolist())
    return outs


@requires_backend("tensorflow")
def test_residual_kept_in_unscaled_units_tf():
    for r in run(worker_tf_units, np=2, timeout=180):
        assert np.allclose(r[0], [1024.0, 0.0])
        assert np.allclose(r[1], [0.0, 256.0])


SPECS = {"fp16": "fp16", "topkc": "topkc:ratio=0.1,chunk=16,min_numel=1", "thc": "thc"}
STEPS = 200
FORCED = 50


def worker_amp_training():
    import horovod.torch as hvd
    import torch
    from tests.digits import digits, mlp
    from torch_backend import Compression
    hvd.init()
    torch.set_num_threads(1)
    x, y, shard = digits(hvd.rank(), hvd.size())
    results = {}
    for label, spec in SPECS.items():
        for scaled in ((False,) if label == "fp16" else (True,)):
            net = mlp()
            comp = Compression.from_spec(spec)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5),
                                           named_parameters=net.named_parameters(), compression=comp)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=10 ** 6) \
                if scaled else None
            if scaler is not None:
                comp.set_loss_scale(scaler)  # read at every compress, on the device
            skipped = 0
            for step in range(STEPS):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(net(x[shard]), y[shard])
                if scaler is None:
                    loss.backward()
                    opt.step()
                    continue
                if step == FORCED and hvd.rank() == 0:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
                opt.synchronize()
                scaler.unscale_(opt)
                before = scaler.get_scale()
                with opt.skip_synchronize():
                    scaler.step(opt)
                scaler.update()
                skipped += scaler.get_scale() < before
            with torch.no_grad():
                loss = float(torch.nn.functional.cross_entropy(net(x), y))
            weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
            results[label] = {"loss": loss, "skipped": int(skipped),
                              "scale": scaler.get_scale() if scaler else None,
                              "weights": weights.numpy().copy()}
    return results


@requires_backend("torch")
def test_amp_training_with_forced_backoff():
    r0, r1 = run(worker_amp_training, np=2, timeout=300)
    fp16 = r0["fp16"]["loss"]
    for label in ("topkc", "thc"):
        assert r0[label]["skipped"] == 1 and r1[label]["skipped"] == 1, label
        assert r0[label]["scale"] == r1[label]["scale"] == 2.0 ** 15, label
        np.testing.assert_array_equal(r0[label]["weights"], r1[label]["weights"])
        assert r0[label]["loss"] <= fp16 * 1.10 + 0.02, (label, r0[label]["loss"], fp16)
