"""Test configuration: the repository root on ``sys.path`` (``ROOT``), quiet TensorFlow logs,
and the backends under test: a test that needs a backend (a ``backend``/``framework``
parameter naming it, a fixture parameter, or ``requires_backend``) is skipped, with the reason,
where that backend is not under test or its framework cannot be imported (a GPU machine
without TensorFlow, say), before any of its fixtures run.

The helpers for backend tensors live in tests/backends.py; they are imported here too, so
``from tests.conftest import BACKENDS`` keeps working.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from tests.backends import (BACKENDS, KNOWN_BACKENDS, as_float64, as_numpy, backend_ops,  # noqa: E402,F401
                            backend_tensor, backend_unusable, backends_of, native_tensor,
                            one_rank_ops, requires_backend, scheme_steps)


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_backend(name): the test needs backend `name` "
                                       "(skipped where it is not under test or does not import)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for name in backends_of(item):
        why = backend_unusable(name)
        if why:
            pytest.skip(why)


@pytest.fixture
def one_thread():
    """PyTorch on one thread for the test (its float sums in one order whatever the CPU's core
    count), the previous count restored after; used by ``pytest.mark.usefixtures("one_thread")``."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The exit status of the session, for pytest_unconfigure below.
_EXIT = {}


def pytest_sessionfinish(session, exitstatus):
    _EXIT["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the process with the session's exit status once pytest has reported everything,
    without running the native libraries' destructors at interpreter exit.

    A process that has loaded TensorFlow, PyTorch, Horovod's and our compiled libraries
    together aborted in a destructor after the summary ("free(): invalid pointer", SIGABRT,
    seen in whole-suite runs and in ``tests/core`` alone, never in any one file), which turned
    a passed run into a failed one. The results are final here; ``HVD_GRADCOMP_TEST_EXIT=normal``
    keeps the ordinary interpreter exit (to look for that destructor)."""
    if "status" not in _EXIT or os.environ.get("HVD_GRADCOMP_TEST_EXIT", "") == "normal":
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT["status"])
