"""hvd-gradcomp: gradient compression for Horovod that pays off end to end.

Versions are pinned in .ci/pins.txt (pip constraints); install with
``pip install -c .ci/pins.txt -e ".[dev]"`` or simply ``make setup``.

Extras: ``torch`` / ``tf`` (a framework and Horovod; ``tf`` takes the ``tensorflow`` package,
which runs on CPUs and GPUs, so a GPU TensorFlow is never replaced by ``tensorflow-cpu``;
``tf-cpu`` takes ``tensorflow-cpu``, for CPU-only machines that have no TensorFlow yet),
``bench`` (what ``python -m
hvd_gradcomp.bench`` needs beyond them: the TTA workers are modules of the package and the
scale model's input file is package data, so an installed package runs every command), ``dev``
(tests; frameworks and Horovod are installed by ``make setup``).
"""
from setuptools import setup

setup(
    name="hvd-gradcomp",
    version="0.1.0",
    description="All-reduce-compatible gradient compressors (TopK/TopKC, THC, PowerSGD, "
                "FP16/BF16) for Horovod, with a time-to-accuracy harness",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=["hvd_gradcomp", "hvd_gradcomp.auto", "hvd_gradcomp.bench", "hvd_gradcomp.bench.workers",
              "torch_backend", "tf_backend"],
    package_data={"hvd_gradcomp.bench": ["*.json"]},
    install_requires=[],
    extras_require={
        "torch": ["torch>=2.0", "horovod>=0.28.1"],
        "tf": ["tensorflow>=2.12,<2.16", "horovod>=0.28.1"],
        "tf-cpu": ["tensorflow-cpu>=2.12,<2.16", "horovod>=0.28.1"],
        # The harness: PyTorch workers (digits-tf also needs the tf extra), sklearn's bundled
        # digits, plots and progress bars.
        "bench": ["torch>=2.0", "horovod>=0.28.1", "numpy", "scikit-learn", "matplotlib", "tqdm"],
        "dev": ["pytest", "scikit-learn", "matplotlib", "tqdm"],
    },
)
