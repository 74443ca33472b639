"""hvd-gradcomp: gradient compression for Horovod and PyTorch DDP/FSDP2 that pays off end to end.

The metadata and extras are in ``pyproject.toml`` (this file is a shim for tools that still
call ``setup.py``). Versions are pinned in .ci/pins.txt (pip constraints); install with
``pip install -c .ci/pins.txt -e ".[dev]"`` or simply ``make setup``.

Extras: ``ddp`` (PyTorch only: the DDP communication hooks and FSDP2's cross-replica
all-reduce, no Horovod, nothing to compile), ``torch`` / ``tf`` (a framework and Horovod, which
builds from source; ``tf`` takes the ``tensorflow`` package, which runs on CPUs and GPUs, so a
GPU TensorFlow is never replaced by ``tensorflow-cpu``; ``tf-cpu`` takes ``tensorflow-cpu``,
for CPU-only machines that have no TensorFlow yet), ``bench`` (what ``python -m
hvd_gradcomp.bench`` needs beyond them: the TTA workers are modules of the package and the
scale model's input file is package data, so an installed package runs every command), ``dev``
(tests, Lightning and Accelerate for the trainer recipes; frameworks and Horovod are installed
by ``make setup``).
"""
from setuptools import setup

setup()
