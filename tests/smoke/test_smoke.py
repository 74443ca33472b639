"""The build works end to end: ``horovodrun -np 2`` (Gloo, and once MPI) trains two steps of
a tiny PyTorch and a tiny TensorFlow model with Horovod's fp16 compression; both ranks must end
with identical parameters equal to a single-process run on the concatenated batch."""
import json
import os
import shutil
import sys

import numpy as np
import pytest

from tests.backends import requires_backend
from tests.hvdrun import run_command

HERE = os.path.dirname(os.path.abspath(__file__))


def _launch(script, transport, tmp_path):
    out = str(tmp_path / f"{script}-{transport}")
    # horovodrun and its ranks are all killed if the launch hangs (tests/hvdrun.py).
    proc = run_command([sys.executable, os.path.join(HERE, script), out], np=2, transport=transport,
                       timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.load(open(f"{out}.{r}.json")) for r in range(2)]


def _torch_reference():
    import torch
    sys.path.insert(0, HERE)
    import train_torch
    net = train_torch.model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = train_torch.batch()
    for _ in range(2):
        opt.zero_grad()
        # Mean over the two halves' losses == what averaging the ranks' gradients computes.
        loss = 0.5 * (torch.nn.functional.mse_loss(net(x[:4]), y[:4]) +
                      torch.nn.functional.mse_loss(net(x[4:]), y[4:]))
        loss.backward()
        opt.step()
    return {k: v.numpy() for k, v in net.state_dict().items()}


def _tf_reference():
    import tensorflow as tf
    sys.path.insert(0, HERE)
    import train_tf
    net = train_tf.model()
    opt = tf.keras.optimizers.SGD(0.1)
    x, y = train_tf.batch()
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = 0.5 * (tf.reduce_mean((net(x[:4]) - y[:4]) ** 2) + tf.reduce_mean((net(x[4:]) - y[4:]) ** 2))
        grads = tape.gradient(loss, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables))
    return net.get_weights()


@requires_backend("torch")
@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_torch_two_steps(tmp_path, transport):
    if transport == "mpi" and not shutil.which("mpirun"):
        pytest.fail("mpirun not found: the set-up must install openmpi-bin")
    ranks = _launch("train_torch.py", transport, tmp_path)
    ref = _torch_reference()
    for k in ref:
        assert np.array_equal(np.array(ranks[0][k]), np.array(ranks[1][k])), k
        # fp16 payloads: gradients rounded to fp16 (relative 2**-11) before the update.
        np.testing.assert_allclose(np.array(ranks[0][k]), ref[k], rtol=1e-3, atol=1e-4, err_msg=k)


@requires_backend("tensorflow")
@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_tf_two_steps(tmp_path, transport):
    ranks = _launch("train_tf.py", transport, tmp_path)
    ref = _tf_reference()
    for i, w in enumerate(ref):
        assert np.array_equal(np.array(ranks[0][i]), np.array(ranks[1][i])), i
        np.testing.assert_allclose(np.array(ranks[0][i]), w, rtol=1e-3, atol=1e-4, err_msg=str(i))
