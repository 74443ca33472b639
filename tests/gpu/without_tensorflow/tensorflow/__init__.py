"""Stands in for TensorFlow where it must be absent: with this folder's parent first on
PYTHONPATH, ``import tensorflow`` fails as on a machine without it (a GPU machine whose Python
has no TensorFlow wheel, say). Used by tests/test_gpu_check.py and by hand:

    PYTHONPATH=tests/gpu/without_tensorflow:$PWD python -m pytest tests/core/test_devices.py
"""
raise ImportError("tensorflow is blocked here (tests/gpu/without_tensorflow is on PYTHONPATH)")
