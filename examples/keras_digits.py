"""Train a digits classifier with Keras ``model.fit`` on Horovod workers, with a gradient compressor.

    horovodrun -np 2 python examples/keras_digits.py --compression thc

Data: scikit-learn's bundled 8x8 digits (no download), each worker a disjoint shard.
Horovod's callbacks start every worker from rank 0's weights and average the metrics over
workers; ``CompressionStatsCallback`` logs, on rank 0 at each epoch's end, the bytes each
worker sends per step against FP16. Keras 2 (TensorFlow <= 2.15), as Horovod 0.28 needs.
"""
import argparse
import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow.keras as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

from tf_backend import Compression  # noqa: E402
from tf_backend.stats import CompressionStatsCallback  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--compression", default="thc", help="e.g. fp16, topkc:0.1, thc, powersgd:4")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=32, help="per worker")
parser.add_argument("--lr", type=float, default=0.025, help="times the number of workers")
parser.add_argument("--log-dir", default=None, help="write TensorBoard scalars here")
args = parser.parse_args()

hvd.init()
logging.basicConfig(level=logging.INFO if hvd.rank() == 0 else logging.WARNING,
                    format="%(message)s")
tf.keras.utils.set_random_seed(0)
tf.config.threading.set_intra_op_parallelism_threads(1)  # the workers share this machine's cores

# Data: a fixed split; each worker trains on every size-th example, tests on all of them.
x, y = load_digits(return_X_y=True)
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
pixels = StandardScaler().fit(x_train)  # zero mean, unit variance per pixel
x_train, x_test = pixels.transform(x_train), pixels.transform(x_test)
per_worker = len(x_train) // hvd.size() // args.batch_size * args.batch_size  # equal full batches
x_train = x_train[hvd.rank()::hvd.size()][:per_worker]
y_train = y_train[hvd.rank()::hvd.size()][:per_worker]

model = tf.keras.Sequential([tf.keras.layers.Dense(256, activation="relu", input_shape=(64,)),
                             tf.keras.layers.Dense(256, activation="relu"),
                             tf.keras.layers.Dense(10)])
compression = Compression.from_spec(args.compression)
optimizer = tf.keras.optimizers.SGD(learning_rate=args.lr * hvd.size(), momentum=0.9)
model.compile(optimizer=hvd.DistributedOptimizer(optimizer, compression=compression),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])

callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # rank 0's initial weights
             hvd.callbacks.MetricAverageCallback(),  # metrics averaged over workers
             CompressionStatsCallback(compression, log_dir=args.log_dir)]
history = model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
                    validation_data=(x_test, y_test), callbacks=callbacks,
                    verbose=2 if hvd.rank() == 0 else 0)

logging.getLogger("example").info("done: final test accuracy %.2f%%",
                                  100 * history.history["val_accuracy"][-1])
