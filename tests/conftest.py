"""Test configuration: the repository root on ``sys.path`` (``ROOT``), quiet TensorFlow logs,
and the backends under test.

The helpers for backend tensors live in tests/backends.py; they are imported here too, so
``from tests.conftest import BACKENDS`` keeps working.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tests.backends import (BACKENDS, KNOWN_BACKENDS, as_float64, as_numpy, backend_ops,  # noqa: E402,F401
                            backend_tensor, native_tensor, one_rank_ops, requires_backend, scheme_steps)
