"""Backend tensors for the tests, in one place: which frameworks are under test, their
primitives, tensors to and from NumPy, and the one-process step loop.

HVD_GRADCOMP_BACKENDS (comma-separated, default "torch,tensorflow") names the backends under
test; an unknown name is an error. Frameworks are imported only when a helper needs them.
"""
import os

import pytest

KNOWN_BACKENDS = ("torch", "tensorflow")
BACKENDS = tuple(b.strip() for b in os.environ.get("HVD_GRADCOMP_BACKENDS", ",".join(KNOWN_BACKENDS)).split(",") if b.strip())
_unknown = [b for b in BACKENDS if b not in KNOWN_BACKENDS]
if _unknown:
    raise pytest.UsageError(f"HVD_GRADCOMP_BACKENDS names unknown backend(s) {_unknown}; known: {KNOWN_BACKENDS}")


_FRAMEWORKS = {"torch": "torch", "tensorflow": "tensorflow"}
_UNUSABLE = {}


def requires_backend(name):
    """Mark a test as needing backend ``name``: skipped unless it is under test and its
    framework imports here (tests/conftest.py, ``pytest_runtest_setup``)."""
    return pytest.mark.requires_backend(name)


def backend_unusable(name):
    """None if backend ``name`` is under test and its framework imports in this process, else
    the reason to skip (the import is tried once per process and remembered)."""
    if name not in BACKENDS:
        return f"backend {name} not under test (HVD_GRADCOMP_BACKENDS)"
    if name not in _UNUSABLE:
        import importlib
        try:
            importlib.import_module(_FRAMEWORKS[name])
            _UNUSABLE[name] = None
        except Exception as exc:  # noqa: BLE001 - any import failure: the backend is unusable here
            _UNUSABLE[name] = (f"backend {name}: `import {_FRAMEWORKS[name]}` fails here "
                               f"({type(exc).__name__}: {exc})")
    return _UNUSABLE[name]


def usable_backends():
    """The backends under test whose framework imports here, in ``BACKENDS`` order."""
    return tuple(b for b in BACKENDS if backend_unusable(b) is None)


def backends_of(item):
    """The backends a collected test needs: its ``requires_backend`` marks, and every parameter
    whose value names a backend ("tensorflow", "torch"; "tf" under a ``framework`` or
    ``backend`` parameter), fixture parameters included."""
    names = [m.args[0] for m in item.iter_markers("requires_backend")]
    callspec = getattr(item, "callspec", None)
    for key, value in (callspec.params.items() if callspec else ()):
        if value == "tf" and key in ("framework", "backend"):
            value = "tensorflow"
        if isinstance(value, str) and value in KNOWN_BACKENDS:
            names.append(value)
    return list(dict.fromkeys(names))


def backend_ops(name):
    """The Primitives instance of a backend by name."""
    if name == "torch":
        from torch_backend import OPS
    else:
        from tf_backend import OPS
    return OPS


def one_rank_ops(name):
    """A backend's primitives with the side all-reduce of a one-rank world (the identity)."""
    from hvd_gradcomp.primitives import one_rank
    return one_rank(backend_ops(name))


def backend_tensor(backend, values, dtype="float32", device=None):
    """A tensor of ``backend`` ("torch"/"tensorflow") holding ``values`` (via float64) as
    ``dtype``, on ``device`` ("cpu", "cuda"; None: the framework's default placement)."""
    import numpy as np
    if backend == "torch":
        import torch
        from torch_backend.ops import to_torch_dtype
        return torch.as_tensor(np.asarray(values, dtype=np.float64)).to(to_torch_dtype(dtype)).to(device or "cpu")
    import tensorflow as tf
    if device is None:
        return tf.cast(tf.constant(np.asarray(values, dtype=np.float64)), dtype)
    with tf.device("/GPU:0" if device == "cuda" else "/CPU:0"):
        return tf.cast(tf.constant(np.asarray(values, dtype=np.float64)), dtype)


def native_tensor(backend, values):
    """A tensor of ``backend`` holding a copy of ``values`` in their own NumPy dtype (float32
    stays float32, int64 stays int64)."""
    import numpy as np
    values = np.asarray(values)
    if backend == "torch":
        import torch
        return torch.tensor(values)
    import tensorflow as tf
    return tf.constant(values, dtype=str(values.dtype))


def as_float64(x):
    """A PyTorch or TensorFlow tensor as a float64 NumPy array (detached)."""
    import numpy as np
    if hasattr(x, "detach"):
        import torch
        return x.detach().to(torch.float64).cpu().numpy()
    import tensorflow as tf
    return np.asarray(tf.cast(x, tf.float64))


def as_numpy(x):
    """A NumPy copy of a PyTorch or TensorFlow tensor, in its own dtype (detached)."""
    import numpy as np
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy().copy()
    return np.array(x, copy=True)


def scheme_steps(ops, scheme, tensors, info):
    """Run compress -> (one-rank all-reduce) -> decompress + finish over ``tensors``.

    Returns one dict per step: payload, ctx, out (decompressed), old (state before) and after
    (state after finish, i.e. the next step's).
    """
    from hvd_gradcomp.base import compress_tensor, finish_tensor
    state = scheme.init(ops, info, tensors[0])
    log = []
    for x in tensors:
        payload, ctx = compress_tensor(scheme, ops, x, state, info)
        out, after = finish_tensor(scheme, ops, payload, ctx, state, info)
        log.append({"payload": payload, "ctx": ctx, "out": out, "old": state, "after": after})
        state = after
    return log


DEVICES = ("cpu", "cuda")


def missing_device(backend, device):
    """None if ``backend`` can place tensors on ``device`` here, else the reason it cannot."""
    if device == "cpu":
        return None
    if backend == "torch":
        import torch
        if torch.cuda.is_available():
            return None
        return (f"no CUDA device for PyTorch {torch.__version__} (torch.cuda.is_available() is False); "
                f"`make gpu-check` runs these on a GPU machine")
    import tensorflow as tf
    if tf.config.list_physical_devices("GPU"):
        return None
    return (f"no GPU visible to TensorFlow {tf.__version__} (a CPU build, or no device); "
            f"`make gpu-check` runs these on a GPU machine")


def scheme_of(spec: str):
    """The scheme a text spec names, e.g. ``scheme_of("topkc:0.1")``."""
    from hvd_gradcomp.registry import make_scheme, parse_spec
    name, options = parse_spec(spec)
    return make_scheme(name, **options)
