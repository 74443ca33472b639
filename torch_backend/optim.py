"""Frozen-variance AdamW for PyTorch: AdamW whose second moment stops moving after a warm-up.

Method (1-bit Adam, Tang et al., ICML 2021; 0/1 Adam, Lu et al., ICLR 2023; Bagua QAdam):
plain AdamW for the first ``freeze_step`` steps of each parameter, then the second moment
``v`` and its bias correction stay frozen, so the step is linear in the gradient the optimizer
receives. Under gradient compression with error feedback (Top-K, PowerSGD), a coordinate's
delayed, bursty delivery then no longer inflates ``v`` and shrinks every later step, and a
burst moves the parameter exactly as the same total spread over several steps would.

Per step ``t`` of a parameter ``p`` with gradient ``g`` (float, on ``p``'s device)::

    p <- p * (1 - lr * weight_decay)
    m <- beta1 * m + (1 - beta1) * g
    if t <= freeze_step or t is a refresh step:       # refresh: off by default
        v <- beta2 * v + (1 - beta2) * g * g;  k <- k + 1     # k: updates v holds
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^k)) + eps)

Up to ``freeze_step`` this is exactly ``torch.optim.AdamW(foreach=False)`` (same operations in
the same order). Freezing is per parameter, on the parameter's own step count (the state's
``step``, as in AdamW); ``freeze_step`` and ``refresh_interval`` are per-group options. Under
``hvd.DistributedOptimizer`` every rank steps every parameter on every step, so the freeze
happens on the same step on every rank without communication.

Refresh (0/1 Adam's idea, simplified; off by default): with ``refresh_interval=R > 0``, ``v``
takes one more gradient at steps ``freeze_step + R * (2^j - 1)``, j = 1, 2, ... (gaps R, 2R,
4R, ...), a schedule every rank computes alike. It takes the gradient delivered that step,
compressed or not.

Note PyTorch's bias correction divides ``v`` by ``1 - beta2^t``: ``beta2 = 1`` does not freeze
``v`` (0/0), hence this class.
"""
import math
import numbers

import torch

__all__ = ["FrozenVarianceAdamW"]

_NAME = "FrozenVarianceAdamW"


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{_NAME}: {name} must be an int >= {low}, got {value!r}")


def _check_float(name, value, low, high=None, high_open=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{_NAME}: {name} must be a finite float, got {value!r}")
    if value < low or (high is not None and (value >= high if high_open else value > high)):
        bound = "" if high is None else (f" and < {high}" if high_open else f" and <= {high}")
        raise ValueError(f"{_NAME}: {name} must be >= {low}{bound}, got {value!r}")


def _check_group(group):
    """ValueError unless a parameter group's options are valid (names the option)."""
    _check_float("lr", group["lr"], 0.0)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{_NAME}: betas must be a pair of floats, got {betas!r}")
    _check_float("betas[0]", betas[0], 0.0, 1.0, high_open=True)
    _check_float("betas[1]", betas[1], 0.0, 1.0, high_open=True)
    _check_float("eps", group["eps"], 0.0)
    _check_float("weight_decay", group["weight_decay"], 0.0)
    _check_int("freeze_step", group["freeze_step"], 1)
    _check_int("refresh_interval", group["refresh_interval"], 0)
    if group.get("amsgrad") or group.get("maximize") or group.get("capturable") or group.get("fused") \
            or group.get("differentiable") or group.get("foreach"):
        raise ValueError(f"{_NAME}: amsgrad, maximize, capturable, fused, differentiable and foreach=True "
                         "are not supported (the update runs per parameter, foreach=False)")
    for i, p in enumerate(group["params"]):
        if not p.is_floating_point() or p.is_complex():
            raise ValueError(f"{_NAME}: parameter {i} of a group has dtype {p.dtype}; only real floating "
                             "point parameters are supported")


def _is_refresh_step(t, freeze_step, refresh_interval):
    """Whether step ``t`` (1-based) of a frozen parameter feeds ``v`` one more gradient:
    ``t = freeze_step + R * (2^j - 1)`` for some j >= 1, with ``R = refresh_interval > 0``."""
    k = t - freeze_step
    if refresh_interval <= 0 or k <= 0 or k % refresh_interval:
        return False
    q = k // refresh_interval
    return (q + 1) & q == 0


class FrozenVarianceAdamW(torch.optim.AdamW):
    """AdamW that freezes its second moment after ``freeze_step`` steps (see the module doc).

    A ``torch.optim.AdamW`` subclass, so ``hvd.DistributedOptimizer(FrozenVarianceAdamW(...),
    compression=...)`` wraps it (Horovod rebuilds it from its parameter groups, which carry
    every option; that is why ``freeze_step`` has a default).

    Args:
        params: parameters or parameter groups (real floating point tensors, any device).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay); floats.
        freeze_step: steps of plain AdamW per parameter before ``v`` freezes (int >= 1).
            1-bit Adam's recipe: long enough for ``v`` to settle (it averages over about
            ``1 / (1 - beta2)`` steps; thousands of steps on large models).
        refresh_interval: 0 (default, off) or R > 0: ``v`` takes one more gradient at steps
            ``freeze_step + R * (2^j - 1)``, j >= 1.
        foreach: None or False only (the update is per parameter).

    State per parameter: ``step`` (float32 tensor on the host, as AdamW's), ``exp_avg`` and
    ``exp_avg_sq`` (like the parameter), ``v_step`` (int: gradients ``exp_avg_sq`` holds, for
    its bias correction). All round-trip through ``state_dict()``/``load_state_dict()``; a
    plain AdamW checkpoint loads too (its ``exp_avg_sq`` holds ``step`` gradients).
    ``step()`` reads only host scalars: no device synchronisation.

    Raises:
        ValueError: an option out of range (naming it), an unsupported AdamW flag, a complex or
            integer parameter, or (in ``step``, before any parameter changes) a sparse gradient.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 freeze_step=1000, refresh_interval=0, *, foreach=None):
        if foreach:
            raise ValueError(f"{_NAME}: foreach=True is not supported (use None or False)")
        _check_group({"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                      "freeze_step": freeze_step, "refresh_interval": refresh_interval, "params": []})
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         amsgrad=False, foreach=False)
        self.defaults["freeze_step"] = freeze_step
        self.defaults["refresh_interval"] = refresh_interval
        for group in self.param_groups:  # groups added by AdamW's __init__ predate the two defaults
            group.setdefault("freeze_step", freeze_step)
            group.setdefault("refresh_interval", refresh_interval)
            _check_group(group)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if "freeze_step" in self.defaults:  # else still in __init__, which checks afterwards
            _check_group(group)

    def __setstate__(self, state):
        # load_state_dict() ends here with the checkpoint's groups: a plain AdamW checkpoint's
        # lack our two options, which then come from this optimizer's defaults.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("freeze_step", self.defaults.get("freeze_step", 1000))
            group.setdefault("refresh_interval", self.defaults.get("refresh_interval", 0))

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step over every parameter with a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if p.grad is not None and p.grad.is_sparse:
                    raise ValueError(f"{_NAME}: parameter {i} has a sparse gradient; only dense gradients "
                                     "are supported (Horovod: sparse_as_dense=True)")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            freeze, refresh = group["freeze_step"], group["refresh_interval"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["v_step"] = 0
                step_t = state["step"]
                if step_t.device.type != "cpu":  # from a capturable/fused checkpoint: once
                    step_t = state["step"] = step_t.to("cpu", torch.float32)
                t = int(step_t) + 1
                step_t.fill_(t)
                v_step = state.get("v_step")
                if v_step is None:  # a plain AdamW checkpoint: v holds every earlier step
                    v_step = t - 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if decay != 0:
                    p.mul_(1 - lr * decay)
                exp_avg.lerp_(grad, 1 - beta1)
                if t <= freeze or _is_refresh_step(t, freeze, refresh):
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    v_step += 1
                state["v_step"] = v_step
                step_size = lr / (1 - beta1 ** t)
                bias_correction2_sqrt = (1 - beta2 ** v_step) ** 0.5 if v_step > 0 else 1.0
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
        return loss

    def frozen(self, p):
        """Whether parameter ``p``'s second moment is frozen (its next step will not feed ``v``,
        bar a refresh): its step count has reached its group's ``freeze_step``."""
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                state = self.state.get(p)
                return bool(state) and int(state["step"]) >= group["freeze_step"]
        raise ValueError(f"{_NAME}.frozen: the tensor is not a parameter of this optimizer")
