"""The ``device`` fixture of tests/core: each test that takes it runs on the CPU and on CUDA;
the CUDA run is skipped, with the reason, where the test's backend sees no GPU."""
import pytest

from tests.backends import DEVICES, missing_device


@pytest.fixture(params=DEVICES)
def device(request):
    """"cpu" or "cuda" (skipped where the test's ``backend`` parameter, default torch, has no GPU)."""
    callspec = getattr(request.node, "callspec", None)
    backend = callspec.params.get("backend", "torch") if callspec else "torch"
    why = missing_device(backend, request.param)
    if why:
        pytest.skip(why)
    return request.param


@pytest.fixture(scope="module")
def one_torch_thread():
    """One PyTorch intra-op thread for a module's tests (small tensors, many calls: many times
    faster on a busy 2-core box); used by the THC tests through ``pytestmark``."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
