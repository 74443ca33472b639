"""The table of fused forms: what the provider modules register on import and
:mod:`torch_backend.kernels` looks up (its docstring states the contract of a fused form).

Kept apart from :mod:`torch_backend.kernels`, which imports the providers, so that a provider
registers here without importing the package that imports it (no import circle).
"""
import torch

__all__ = ["register", "registered", "has_form", "writable"]

# (reference fn, provider device type) -> [(accepts, run, name)]
_FORMS = {}
# reference fns that have a fused form on some device type (filled by register)
_HAVE = set()


def register(reference, device: str, accepts, run, name: str = None):
    """Make ``run(plan, *tensors)`` the fused form of ``reference`` on ``device`` (a torch device
    type, ``"cuda"`` or ``"cpu"``) for the plans where ``accepts(plan)`` is true. Called by the
    provider modules on import."""
    _FORMS.setdefault((reference, device), []).append(
        (accepts, run, name or getattr(run, "__name__", repr(run))))
    _HAVE.add(reference)


def registered(reference, device: str):
    """The ``(accepts, run, name)`` registered for ``reference`` on ``device``, in order."""
    return tuple(_FORMS.get((reference, device), ()))


def has_form(reference) -> bool:
    """True when ``reference`` has a fused form registered on some device type."""
    return reference in _HAVE


def writable(into, limit: int, device) -> bool:
    """True when a fused form may write its float32 result into ``into`` (a kernel's optional
    destination, e.g. an engine's bucket slice): a contiguous float32 1-D tensor of at most
    ``limit`` values on ``device``."""
    return (into is not None and into.dtype == torch.float32 and into.dim() == 1 and into.shape[0] <= limit
            and into.device == device and into.is_contiguous())
