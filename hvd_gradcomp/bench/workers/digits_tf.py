"""Digits classifier in TensorFlow (Keras 2 + ``hvd.DistributedGradientTape``), compressor as a spec.

    horovodrun -np 2 --gloo python -m hvd_gradcomp.bench.workers.digits_tf --compression topkc:ratio=0.1

The same workload as :mod:`.digits_torch`: a Keras MLP 64-2048-2048-10 (4,349,962
parameters) on scikit-learn's digits, SGD with momentum 0.9, data sharded by rank, fixed
seeds (``--seed``; Keras' own initialisers, so not the PyTorch run's initial weights).

The step is a ``tf.function`` in which Horovod's ``DistributedGradientTape`` compresses,
all-reduces and decompresses every gradient, so ``compress`` runs at trace time and Python
timers around it would time tracing. Time split instead:

- compress+decompress: measured inside the graph (:class:`GraphTimedCompressor`):
  ``tf.timestamp()`` before and after each tensor's ``compress`` and ``decompress``, chained by
  control dependencies so the intervals never overlap, minus the side collectives issued inside
  ``compress`` (bracketed the same way), summed into a variable read after the step;
- compute: forward + backward measured without communication (a plain ``tf.GradientTape``
  step on the same batch every ``--eval-every`` steps, off the clock; the median is used) plus
  the optimizer update (a separate ``tf.function``, timed);
- communication: the rest of the step.
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402

from tf_backend import Compression  # noqa: E402

from .. import data  # noqa: E402
from ..worker import OPTIMIZERS, Recorder, add_common_args, optimizer_class, parse_optimizer  # noqa: E402

DEFAULTS = dict(target=0.96, lr=0.05, batch_size=32, eval_every=5, max_epochs=20)


class GraphTimedCompressor:
    """A Horovod compressor proxy that times ``compress``/``decompress`` inside the graph.

    ``codec`` (float64 variable, seconds) accumulates compress + decompress time minus the
    side collectives (``side``); the worker reads and zeroes both after each step. Valid in
    ``tf.function`` and eagerly. Horovod caches its functions per compressor: this object
    hashes by identity.
    """

    def __init__(self, inner):
        self.inner = inner
        with tf.init_scope():
            self.codec = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="tta_codec_s")
            self.side = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="tta_side_s")
        self._last = {}  # graph -> last timestamp of the chain in that graph
        self._inside = False
        self._original = hvd.allreduce
        hvd.allreduce = self._side_allreduce  # also the name Horovod's own helpers look up

    def close(self):
        hvd.allreduce = self._original

    def _stamp(self, after):
        graph = tf.compat.v1.get_default_graph()
        deps = list(after) + ([self._last[graph]] if graph in self._last else [])
        with tf.control_dependencies(deps):
            t = tf.timestamp()
        self._last[graph] = t
        return t

    @tf.autograph.experimental.do_not_convert
    def _side_allreduce(self, tensor, *args, **kwargs):
        if not self._inside:
            return self._original(tensor, *args, **kwargs)
        t0 = self._stamp([tensor])
        with tf.control_dependencies([t0]):
            out = self._original(tensor, *args, **kwargs)
        t1 = self._stamp([out])
        with tf.control_dependencies([self.side.assign_add(t1 - t0)]):
            return tf.identity(out)

    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor):
        t0 = self._stamp([tensor])
        self._inside = True
        try:
            with tf.control_dependencies([t0]):
                payload, ctx = self.inner.compress(tensor)
        finally:
            self._inside = False
        t1 = self._stamp([payload])
        with tf.control_dependencies([self.codec.assign_add(t1 - t0)]):
            return tf.identity(payload), ctx

    @tf.autograph.experimental.do_not_convert
    def decompress(self, payload, ctx):
        t0 = self._stamp([payload])
        with tf.control_dependencies([t0]):
            out = self.inner.decompress(payload, ctx)
        t1 = self._stamp([out])
        with tf.control_dependencies([self.codec.assign_add(t1 - t0)]):
            return tf.identity(out)

    def take(self):
        """Compress+decompress seconds (side collectives excluded) and side seconds; resets."""
        side = float(self.side.numpy())
        codec = float(self.codec.numpy()) - side
        self.codec.assign(0.0)
        self.side.assign(0.0)
        return codec, side


# PyTorch-style option names (the sweep's rows use them) -> Keras constructor arguments.
_KERAS_NAMES = {"lr": "learning_rate", "eps": "epsilon"}


def build_optimizer(text, lr):
    """Keras optimizer of a run: SGD with momentum 0.9 (the workload's own, Keras' legacy
    class) for an empty ``text``, else the class :data:`..worker.OPTIMIZERS` names for
    TensorFlow, imported only here; ``lr``/``eps``/``betas=b1/b2`` become ``learning_rate``,
    ``epsilon``, ``beta_1``/``beta_2``, other options pass as they are.

    Raises:
        ValueError: a bad ``text``, a class not in this checkout, or options its constructor
            rejects (named, with its message).
    """
    name, opts = parse_optimizer(text)
    if name is None:
        return tf.keras.optimizers.legacy.SGD(learning_rate=lr, momentum=0.9)
    cls = optimizer_class(name, "tensorflow")
    kwargs = {"learning_rate": lr}
    for k, v in opts.items():
        if k == "betas":
            kwargs["beta_1"], kwargs["beta_2"] = v
        else:
            kwargs[_KERAS_NAMES.get(k, k)] = v
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"optimizer {name}: {OPTIMIZERS[name]['tensorflow'].replace(':', '.')} rejected its options {kwargs}: {e}") from None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, higher_is_better=True, **DEFAULTS)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--eager", action="store_true",
                        help="run the communicating step eagerly, not as a tf.function (auto "
                             "runs eagerly only; the tta workload digits-tf-eager runs every row so)")
    args = parser.parse_args(argv)
    hvd.init()
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.random.set_seed(args.seed)
    rank, size = hvd.rank(), hvd.size()

    x_train, y_train, x_test, y_test = data.digits()
    x_test, y_test = x_test[rank::size], y_test[rank::size]
    steps_per_epoch = (len(x_train) // size) // args.batch_size
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(args.hidden, activation="relu", input_shape=(64,)),
        tf.keras.layers.Dense(args.hidden, activation="relu"),
        tf.keras.layers.Dense(10)])
    hvd.broadcast_variables(model.variables, root_rank=0)
    try:
        opt = build_optimizer(args.optimizer, args.lr)
    except ValueError as e:  # the same on every rank, before any training collective
        print(f"digits_tf worker: {e}", file=sys.stderr, flush=True)
        hvd.shutdown()
        return 2
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compressor = GraphTimedCompressor(Compression.from_spec(args.compression))

    def reduced_grads(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compressor, op=hvd.Average)
        return loss, tape.gradient(loss, model.trainable_variables)

    if args.eager:
        # Horovod's DistributedGradientTape runs its all-reduces in a tf.function of its own,
        # even when called eagerly; this runs that one eagerly too, as auto needs.
        tf.config.run_functions_eagerly(True)
    else:
        reduced_grads = tf.function(reduced_grads)

    @tf.function
    def local_grads(x, y):  # the same forward/backward without communication (calibration)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    @tf.function
    def apply(grads):
        opt.apply_gradients(zip(grads, model.trainable_variables))

    meta = {"framework": "tensorflow", "system": "horovod", "label": args.compression,
            "workload": "digits-eager" if args.eager else "digits", "metric": "test accuracy",
            "model": f"Keras MLP 64-{args.hidden}-{args.hidden}-10",
            "versions": {"tensorflow": tf.__version__, "horovod": horovod.__version__,
                         "numpy": np.__version__},
            "params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
            "tf_codec_timing": "in-graph tf.timestamp, side collectives excluded"}
    rec = Recorder(args, rank, size, steps_per_epoch, True, meta)
    # Trace the step functions before the clock starts (compress runs at trace time, creating
    # the compressor's state variables; nothing executes, so no state changes).
    xs = tf.TensorSpec([args.batch_size, 64], tf.float32)
    ys = tf.TensorSpec([args.batch_size], tf.int64)
    if not args.eager:
        reduced_grads.get_concrete_function(xs, ys)
    local_grads.get_concrete_function(xs, ys)
    apply.get_concrete_function([tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_variables])
    calib = []

    def evaluate():
        correct = float(tf.reduce_sum(tf.cast(tf.argmax(model(x_test), 1) == y_test, tf.float32)))
        out = hvd.allreduce(tf.constant([correct, float(len(y_test)), rec.clock], tf.float64),
                            op=hvd.Sum, name="tta.eval").numpy()
        return rec.evaluate(out[0] / out[1], out[2] / size)

    wire = None
    stop = evaluate()
    epoch = 0
    while not stop and rec.step_count < rec.max_steps:
        idx = data.shard_indices(len(x_train), rank, size, args.seed, epoch)
        for i in range(steps_per_epoch):
            j = idx[i * args.batch_size:(i + 1) * args.batch_size]
            x, y = tf.constant(x_train[j]), tf.constant(y_train[j])
            if rec.step_count % args.eval_every == 0:  # calibration, off the clock
                t0 = time.perf_counter()
                local_grads(x, y)[0].numpy()
                calib.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            loss, grads = reduced_grads(x, y)
            _ = [g.numpy() for g in grads[:1]]  # results are ready when the call returns on CPU
            t1 = time.perf_counter()
            apply(grads)
            t2 = time.perf_counter()
            codec, side = compressor.take()
            fb = statistics.median(calib[-5:])
            rec.step(fb + (t2 - t1), codec, (t1 - t0) - fb - codec, float(loss))
            if wire is None:
                w = compressor.inner.bytes_per_step()
                wire = {"payload": w.payload, "side": w.side, "side_collectives": w.side_collectives}
            if rec.due() and evaluate():
                stop = True
                break
        epoch += 1
    rec.write(wire)
    compressor.close()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
