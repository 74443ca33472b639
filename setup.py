"""hvd-gradcomp: gradient compression for Horovod that pays off end to end.

Versions are pinned in .ci/pins.txt (pip constraints); install with
``pip install -c .ci/pins.txt -e ".[dev]"`` or simply ``make setup``.
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
    packages=["hvd_gradcomp", "hvd_gradcomp.bench", "torch_backend", "tf_backend"],
    package_data={"hvd_gradcomp.bench": ["*.json"]},
    install_requires=[],
    extras_require={
        "torch": ["torch>=2.0", "horovod>=0.28.1"],
        "tf": ["tensorflow-cpu>=2.12,<2.16", "horovod>=0.28.1"],
        "dev": ["pytest", "scikit-learn", "matplotlib", "tqdm"],
    },
)
