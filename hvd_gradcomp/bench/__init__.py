"""Benchmarks and the time-to-accuracy harness (``python -m hvd_gradcomp.bench``).

Unlike the compression path, this package may use NumPy and matplotlib.
"""
