"""Offline datasets of the time-to-accuracy workloads (NumPy only; every machine has them).

1. ``digits``: scikit-learn's bundled handwritten digits (``sklearn.datasets.load_digits``:
   1797 images of 8x8 pixels, values 0..16, 10 classes). Fixed split: a stratified 80/20
   ``train_test_split`` with ``random_state=0`` (1437 train, 360 test). Features are scaled
   to [0, 1] and standardised with the training set's per-pixel mean and std.
2. ``stdlib``: bytes of the running Python's own standard-library source files, a fixed list
   (:data:`STDLIB_TRAIN`, :data:`STDLIB_VALID`; whole files, so train and validation share
   no file). Tokens are bytes (vocabulary 256). The files differ slightly between Python
   versions, so :func:`stdlib_corpus` also returns a SHA-256 of the bytes, recorded with
   every run.

Sharding: :func:`shard_indices` gives rank ``r`` of ``n`` every n-th index of a permutation
that depends only on (seed, epoch), identical on every rank, so the ranks' shards are
disjoint and together cover the epoch.
"""
import hashlib
import os
import sysconfig

import numpy as np

__all__ = ["digits", "stdlib_corpus", "shard_indices", "STDLIB_TRAIN", "STDLIB_VALID"]

# Modules present (as single .py files) in CPython 3.9 to 3.13.
STDLIB_TRAIN = (
    "argparse", "ast", "base64", "bisect", "calendar", "configparser", "copy", "csv",
    "dataclasses", "difflib", "enum", "fractions", "functools", "gzip", "heapq", "inspect",
    "pprint", "random", "shutil", "statistics", "string", "tarfile", "textwrap", "threading",
    "typing")
STDLIB_VALID = ("imaplib", "shlex", "tokenize")


def digits():
    """The digits split: ``(x_train [1437, 64] float32, y_train [1437] int64, x_test, y_test)``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float32) / 16.0
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y)
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0) + 1e-3  # some border pixels are always 0: avoid 0/0
    x_train = ((x_train - mean) / std).astype(np.float32)
    x_test = ((x_test - mean) / std).astype(np.float32)
    return x_train, y_train.astype(np.int64), x_test, y_test.astype(np.int64)


def stdlib_corpus():
    """``(train uint8 [n], valid uint8 [m], info)``: the byte corpus of :data:`STDLIB_TRAIN`/``VALID``.

    ``info`` has ``stdlib`` (the folder), ``sha256`` (of train + valid bytes), ``train_bytes``,
    ``valid_bytes`` and the file lists. Files are joined in list order, each followed by a
    NUL byte (a document separator).

    Raises:
        FileNotFoundError: a listed module is missing (an unusual Python build).
    """
    folder = sysconfig.get_paths()["stdlib"]
    digest = hashlib.sha256()
    parts = {}
    for split, names in (("train", STDLIB_TRAIN), ("valid", STDLIB_VALID)):
        chunks = []
        for name in names:
            with open(os.path.join(folder, name + ".py"), "rb") as f:
                data = f.read()
            digest.update(data)
            chunks.append(data + b"\0")
        parts[split] = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    info = {"stdlib": folder, "sha256": digest.hexdigest(), "train_bytes": int(parts["train"].size),
            "valid_bytes": int(parts["valid"].size), "train_files": list(STDLIB_TRAIN),
            "valid_files": list(STDLIB_VALID)}
    return parts["train"], parts["valid"], info


def shard_indices(n_items: int, rank: int, world_size: int, seed: int, epoch: int):
    """This rank's indices for one epoch: ``perm[rank::world_size]`` of a shared permutation.

    The permutation depends on (seed, epoch) only, so all ranks agree on it without talking.
    Each shard is cut to ``n_items // world_size`` so every rank runs the same number of steps.
    """
    perm = np.random.default_rng([seed, epoch]).permutation(n_items)
    per_rank = n_items // world_size
    return perm[rank::world_size][:per_rank]
