"""Smoke test worker (TensorFlow): two steps of a tiny Keras 2 model with
hvd.DistributedGradientTape and Horovod's own fp16 compression; each rank writes its final
weights to ``<out>.<rank>.json``. Rank r trains on rows [4r, 4r+4) of a fixed batch of 8.
"""
import json
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd


def batch():
    g = np.random.default_rng(1)
    return g.standard_normal((8, 5)).astype(np.float32), g.standard_normal((8, 3)).astype(np.float32)


def model():
    tf.keras.utils.set_random_seed(0)
    net = tf.keras.Sequential([tf.keras.layers.Dense(4, activation="tanh"), tf.keras.layers.Dense(3)])
    net.build((None, 5))
    return net


def main(out):
    hvd.init()
    net = model()
    opt = tf.keras.optimizers.SGD(0.1)
    hvd.broadcast_variables(net.variables, root_rank=0)
    x, y = batch()
    lo, hi = 4 * hvd.rank(), 4 * hvd.rank() + 4

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((net(xb) - yb) ** 2)
        tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16)
        grads = tape.gradient(loss, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables))

    for _ in range(2):
        step(x[lo:hi], y[lo:hi])
    with open(f"{out}.{hvd.rank()}.json", "w") as f:
        json.dump([w.tolist() for w in net.get_weights()], f)


if __name__ == "__main__":
    main(sys.argv[1])
