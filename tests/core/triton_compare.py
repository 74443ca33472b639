"""(Helper, not a test.) The comparisons of the Triton checks (:mod:`tests.core.triton_checks`,
whose docstring states what "agrees" means): structure, equality, closeness within a tolerance
relative to each group's norm (finite and non-finite steps) or to the whole's, and seeded
inputs. Each returns a list of problems (strings; empty when the outputs agree).
"""
import torch

__all__ = ["TOL", "TOL_RANGE", "BLOCK", "same_structure", "equal_values", "close_in_groups",
           "close_nonfinite", "close_relative", "seeded", "randn_on"]

TOL = 2.0 ** -20
TOL_RANGE = 2.0 ** -17  # a block's norm: 1024 squares summed in another order
BLOCK = 1024


def same_structure(name, got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    if len(got) != len(want):
        return [f"{name}: {len(got)} outputs, reference {len(want)}"]
    out = []
    for i, (a, b) in enumerate(zip(got, want)):
        if (tuple(a.shape), a.dtype, a.device) != (tuple(b.shape), b.dtype, b.device):
            out.append(f"{name}[{i}]: {tuple(a.shape)} {a.dtype} {a.device}, reference "
                       f"{tuple(b.shape)} {b.dtype} {b.device}")
    return out


def equal_values(name, a, b):
    a, b = a.cpu().reshape(-1), b.cpu().reshape(-1)
    if a.is_floating_point():
        same = torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
            torch.nan_to_num(a, 0.0, 1.0, -1.0), torch.nan_to_num(b, 0.0, 1.0, -1.0))
    else:
        same = torch.equal(a, b)
    if same:
        return []
    differ = (a != b) if not a.is_floating_point() else ~((a == b) | (torch.isnan(a) & torch.isnan(b)))
    return [f"{name}: {int(differ.sum())} of {a.numel()} values differ (first at {int(differ.nonzero()[0])})"]


def close_in_groups(name, a, b, group=BLOCK, tol=TOL):
    """Within ``tol`` of the reference, relative to the norm of each group of ``group`` values."""
    a, b = a.detach().cpu().double().reshape(-1), b.detach().cpu().double().reshape(-1)
    if not torch.equal(torch.isnan(a), torch.isnan(b)):
        return [f"{name}: NaN at other positions than the reference's"]
    if not torch.equal(torch.isinf(a), torch.isinf(b)) or not torch.equal(a[torch.isinf(a)], b[torch.isinf(b)]):
        return [f"{name}: inf at other positions than the reference's"]
    finite = torch.isfinite(b)
    a, b = torch.where(finite, a, 0.0), torch.where(finite, b, 0.0)
    pad = -a.numel() % group
    a, b = torch.cat([a, a.new_zeros(pad)]), torch.cat([b, b.new_zeros(pad)])
    err = (a - b).reshape(-1, group).abs().amax(1)
    bound = tol * b.reshape(-1, group).norm(dim=1) + 1e-30
    if bool((err <= bound).all()):
        return []
    worst = float((err / bound).max())
    return [f"{name}: off by {worst:.3g} x the tolerance ({tol:.3g} of the group's norm)"]


def close_nonfinite(name, a, b, group=BLOCK, tol=TOL):
    """:func:`close_in_groups` for an output of a step that is not finite (module docstring): within
    ``tol`` in each group of ``group`` values that is finite in the reference ``b``; in every
    other group at least one non-finite value in ``a`` (of any kind, at any position)."""
    a, b = a.detach().cpu().double().reshape(-1), b.detach().cpu().double().reshape(-1)
    pad = -a.numel() % group
    a, b = torch.cat([a, a.new_zeros(pad)]).reshape(-1, group), torch.cat([b, b.new_zeros(pad)]).reshape(-1, group)
    finite_ref, finite_got = torch.isfinite(b).all(1), torch.isfinite(a).all(1)
    problems = []
    lost = (~finite_ref & finite_got).nonzero().flatten().tolist()
    if lost:
        problems.append(f"{name}: finite in groups {lost[:8]} where the reference is not")
    keep = finite_ref.nonzero().flatten()
    if keep.numel():
        problems += close_in_groups(name, a[keep].reshape(-1), b[keep].reshape(-1), group, tol)
    return problems


def seeded(seed, device):
    return torch.Generator().manual_seed(seed), torch.device(device)


def randn_on(g, n, device, scale=1.0):
    return (torch.randn(n, generator=g, dtype=torch.float32) * scale).to(device)

def close_relative(name, a, b, tol, at_least=0.0):
    """``a`` within ``tol`` of ``b`` relative to the larger of ``b``'s norm and ``at_least``."""
    a, b = a.detach().cpu().double().reshape(-1), b.detach().cpu().double().reshape(-1)
    err, size = float((a - b).norm()), max(float(b.norm()), at_least)
    return [] if err <= tol * size + 1e-30 else [f"{name}: relative error {err / max(size, 1e-30):.3g} > {tol:.3g}"]
