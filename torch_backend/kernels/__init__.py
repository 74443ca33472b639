"""Hand-written fused forms of the core's kernels, behind ``Primitives.fuse``.

The core writes each kernel once, as a composition of primitives: a module-level function
``fn(ops, plan, *tensors)`` such as :func:`hvd_gradcomp.thc_kernels._rotate_kernel`. That
composition is the reference. This package lets the PyTorch backend supply, per device type, a
*fused form* of the same function: one or a few passes over memory (a Triton kernel on CUDA, a
compiled loop on the CPU) instead of one framework operation per step of the math.

The contract of a fused form ``run(plan, *tensors)`` of ``fn``:

- the same inputs and outputs as ``fn(OPS, plan, *tensors)``: structure, shapes, dtypes and
  devices; values equal to the reference's where the math is exact (integer payloads, level
  choices given equal inputs) and within float32 rounding elsewhere, as its docstring states
  and its tests check against the reference;
- no host read, no synchronisation, no collective; state stays on the tensors' device;
- ``accepts(plan)`` says which plans it covers (e.g. THC's default 1024-coordinate rotation
  blocks); for any other plan, and on any device without a fused form, the reference runs.

:func:`dispatch` is what ``torch_backend.ops`` calls from ``fuse``: it returns the reference
itself when ``fn`` has no fused form anywhere (no cost), else a runner that picks by the device
of the first tensor argument. A fused form whose first call raises (a kernel that does not
build on this machine, say) is dropped for that plan and device with one ``RuntimeWarning``
naming it, and the reference runs from then on.

Providers register on import (:func:`register`, kept in :mod:`~torch_backend.kernels.forms`,
which imports no provider) and are imported on the first call on their device type:
``"cuda"``: the Triton kernels (when ``triton`` imports); ``"cpu"``: the compiled CPU loops;
both: the constant tables cached per device (:mod:`~torch_backend.kernels.tables`).
A provider that cannot be imported (no ``triton``, no compiled library) leaves the reference in
place; :func:`status` says why.

``HVD_GRADCOMP_KERNELS`` (read at each lookup): ``1``/``on`` or unset, the fused forms of each
device type; ``0``/``off``, none (the reference everywhere: the unfused side of tests and
benchmarks); ``triton``, the Triton forms on every device type, CPU tensors included, which
with ``TRITON_INTERPRET=1`` runs the Triton kernels in Triton's interpreter (how CI tests them
without a GPU).
"""
import importlib
import os
import warnings

from .forms import has_form, register, registered

__all__ = ["register", "dispatch", "fused_form", "mode", "status", "ENV", "PROVIDERS"]

ENV = "HVD_GRADCOMP_KERNELS"

# Device type -> provider modules, imported on the first lookup for that device type.
PROVIDERS = {
    "cuda": ("torch_backend.kernels.triton_thc", "torch_backend.kernels.triton_thc_fused",
             "torch_backend.kernels.triton_topkc",
             "torch_backend.kernels.triton_powersgd", "torch_backend.kernels.triton_signsgd",
             "torch_backend.kernels.tables"),
    "cpu": ("torch_backend.kernels.cpu_thc", "torch_backend.kernels.cpu_topkc", "torch_backend.kernels.cpu_powersgd",
            "torch_backend.kernels.cpu_signsgd", "torch_backend.kernels.tables"),
}
# "triton" mode: these providers serve every device type.
_TRITON = "cuda"

# provider module -> None (imported) or the reason it could not be
_LOADED = {}
# (fn, plan, device type, mode) -> run or None, after the first call decided
_CHOSEN = {}


def mode() -> str:
    """``"on"``, ``"off"`` or ``"triton"``, from ``HVD_GRADCOMP_KERNELS``.

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "1", "on", "true"):
        return "on"
    if value in ("0", "off", "false"):
        return "off"
    if value == "triton":
        return "triton"
    raise ValueError(f"{ENV} must be 1/on, 0/off or triton, got {value!r}")


def _load(device: str, warn: bool = True):
    for module in PROVIDERS.get(device, ()):
        if module in _LOADED:
            continue
        try:
            importlib.import_module(module)
            _LOADED[module] = None
        except ImportError as exc:  # no triton, no compiled library: the reference stays
            _LOADED[module] = f"{type(exc).__name__}: {exc}"
            if warn and (not isinstance(exc, ModuleNotFoundError) or exc.name != module):
                # once per process and provider: the schemes run, slower, on the reference
                warnings.warn(f"hvd_gradcomp: no fused kernels from {module} on {device} "
                              f"({_LOADED[module]}); the reference compositions run instead (same "
                              f"results within rounding, slower). torch_backend.kernels.status() "
                              f"lists every provider", RuntimeWarning)


def fused_form(reference, plan, device: str):
    """The fused ``run(plan, *tensors)`` registered for ``reference`` on ``device`` that
    accepts ``plan``, or None. For tests and benchmarks: ``ops.fuse`` goes through
    :func:`dispatch`."""
    _load(device)
    for accepts, run, _ in registered(reference, device):
        if accepts(plan):
            return run
    return None


def status() -> dict:
    """Provider module -> ``"loaded"`` or why it could not be imported (for bug reports and
    ``python -m hvd_gradcomp.bench``); providers not needed yet are loaded first."""
    mode()  # a bad HVD_GRADCOMP_KERNELS is named here too
    for device in PROVIDERS:
        _load(device, warn=False)
    return {m: reason or "loaded" for m, reason in _LOADED.items()}


def _device_type(tensors) -> str:
    for t in tensors:
        device = getattr(t, "device", None)
        if device is not None:
            return device.type
    return "cpu"


def dispatch(fn, plan, reference):
    """``Primitives.fuse``'s choice for ``fn`` and ``plan``: ``reference`` (a callable of the
    tensors) where no fused form applies, else a runner that calls the fused form on the device
    types it serves and ``reference`` elsewhere (module docstring)."""
    if not has_form(fn) and not _pending():
        return reference
    current = mode()
    if current == "off":
        return reference

    def run(*tensors):
        device = _device_type(tensors)
        key = (fn, plan, device, current)
        form = _CHOSEN.get(key, False)
        if form is False:
            form = fused_form(fn, plan, _TRITON if current == "triton" else device)
            if form is None:
                _CHOSEN[key] = None
                return reference(*tensors)
            try:
                out = form(plan, *tensors)
            except Exception as exc:  # noqa: BLE001 - a kernel that fails once falls back, once
                warnings.warn(f"hvd_gradcomp: the fused form {form.__module__}.{form.__name__} of "
                              f"{fn.__name__} failed on {device} ({type(exc).__name__}: {exc}); "
                              f"running the reference", RuntimeWarning)
                _CHOSEN[key] = None
                return reference(*tensors)
            _CHOSEN[key] = form
            return out
        if form is None:
            return reference(*tensors)
        return form(plan, *tensors)
    return run


def _pending() -> bool:
    """True while some provider module has not been tried (its forms may not be registered)."""
    return any(m not in _LOADED for mods in PROVIDERS.values() for m in mods)
