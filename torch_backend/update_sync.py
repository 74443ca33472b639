"""Compressed update sync: each rank steps its own optimizer, the ranks average the
compressed change of the parameters (PyTorch, on Horovod or ``torch.distributed``).

Usage::

    import horovod.torch as hvd
    from torch_backend import Compression, UpdateSync

    hvd.init()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sync = UpdateSync(opt, model=model, compression=Compression.topkc(0.1), every=1)
    for x, y in data:
        sync.zero_grad()
        loss_fn(model(x), y).backward()   # no gradient all-reduce: the gradient stays local
        sync.step()                       # opt.step() on this rank's gradient; every H steps: a sync

**Method.** Every rank keeps the parameters of the last sync, ``theta`` (equal on every rank),
and steps its own optimizer on its own gradient (each rank's optimizer state, e.g. Adam's
moments, sees only that rank's gradients). Every ``every`` = H steps, each rank compresses the
change of each parameter since the last sync, ``delta_r = p_r - theta``, under the parameter's
name as the tensor key (:meth:`~hvd_gradcomp.codec.Codec.encode`, so routing
rules match parameter names), and the ranks sum the payloads by one all-reduce per tensor
(posted as soon as the tensor is encoded; Horovod's ``allreduce_async``, or
``dist.all_reduce(async_op=True)`` on the group). The decoded mean ``d = sum_r C(delta_r) / n``
is the averaged change. The compressor's error feedback works on the change: what it did not
deliver of ``delta_r`` stays in rank r's residual and joins the next sync's change.

- H = 1 (the default; CocktailSGD's form): ``theta <- theta + d``.
- H > 1 (local steps; DiLoCo's form): an outer optimizer steps ``theta`` with the outer
  gradient ``-d``: SGD with Nesterov momentum, learning rate ``outer_lr`` (default 0.7) and
  momentum ``outer_momentum`` (default 0.9), as in Douillard et al., DiLoCo (2023). Given
  explicitly, ``outer_lr``/``outer_momentum`` apply at H = 1 as well.

Then every rank's parameters are set to ``theta``: equal on every rank after each sync (every
rank decodes the same all-reduced payloads with the same arithmetic). The constructor first
broadcasts rank 0's parameters, so the ranks start equal.

When to use it instead of gradient compression (:doc:`docs/update-sync.md`): under Adam-type
optimizers, compressing the gradient feeds the optimizer's shared state with delayed,
bursty coordinates (error feedback holds a Top-K coordinate back for about 1/ratio steps);
syncing the compressed update keeps each rank's optimizer on its exact local gradient and
puts the compression error on the parameters only. With H > 1 it also sends H times fewer
bytes and collectives.

**Counts.** Every sync (and every overlapped sync point) first sums, in one small blocking
all-reduce, each rank's sync number and its count of ``step()`` calls; when they differ (a
rank skipped a ``step()``, or called ``synchronize()`` alone) every rank raises the same
ValueError naming UpdateSync and each rank's counts, before any payload is posted
(:class:`~torch_backend.update_sync_rounds.Exchange`). ``synchronize()`` with no step since
the last sync changes nothing; it still checks the counts.

**AMP.** Pass the UpdateSync itself to the scaler: ``scaler.scale(loss).backward();
scaler.step(sync); scaler.update()``. UpdateSync declares ``_step_supports_amp_scaling``, so
``GradScaler.step`` calls ``sync.step()`` on every rank and every iteration with its
``found_inf`` and ``grad_scale``: a rank whose gradient has an inf skips its inner step, the
step still counts, and the sync comes at the same call on every rank (each rank's scaler
backs off on its own inf; the gradient is local, so the ranks need not skip together).

**Overlap** (``overlap=True``, opt-in): the all-reduce of a round is posted without waiting
and applied one sync point later, optionally in ``fragments`` synced in turn (Streaming
DiLoCo); ``eager`` chooses how the rank's own change stands in until the mean arrives
(:mod:`torch_backend.update_sync_rounds`). ``theta`` is equal on every rank after each applied
round; ``synchronize()`` drains (every rank's parameters then equal).

**Checkpoints.** :meth:`state_dict` holds this rank's part of an exact resume: the synced
parameters ``theta``, the steps since the last sync, the compressor's state (its residuals:
per rank), the outer optimizer's state and the inner optimizer's state; with ``overlap`` the
round in flight is waited for and its mean saved unapplied. Save it on every rank
with the model's ``state_dict()`` (between syncs with H > 1 the local parameters differ from
``theta``); :meth:`load_state_dict` restores it on the same rank.

**Refused** with a ValueError/TypeError, before any collective and alike on every rank: an
optimizer wrapped by ``hvd.DistributedOptimizer`` or an ``UpdateSync`` wrapped by it, a DDP
model (both would all-reduce the gradients as well: two synchronisations), a compressor that
has already compressed tensors or is bound to another engine, blocking two-round variants on
``torch.distributed`` (their side all-reduce is Horovod's), non-float or sparse parameters,
``every`` < 1, outer options out of range, ``fragments`` that do not divide ``every`` or
without ``overlap``. **Uneven inputs** are refused, not handled: with Horovod, a rank inside
``hvd.join()`` contributes zeros to the sync's all-reduces, which would average in a zero
change; the count check sees its row missing and the ranks still training raise a
ValueError naming it; ``torch.distributed``'s ``Join`` context refuses UpdateSync as a
joinable (:meth:`join_hook`). Give every rank the same number of steps instead (e.g. drop the
last incomplete batches).
"""
import copy
import time

import torch

from hvd_gradcomp.base import StepBytes

from .compression import check_compressor
from .update_sync_rounds import HOROVOD as _HOROVOD, TORCH as _TORCH, Exchange, OverlapSchedule, apply_means

__all__ = ["UpdateSync"]


def _horovod_initialized():
    try:
        import horovod.torch as hvd
        return hvd.is_initialized()
    except (ImportError, ValueError):
        return False


def _torch_initialized():
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _is_horovod_optimizer(obj):
    """True for an optimizer made by ``hvd.DistributedOptimizer`` (its class is built from
    Horovod's ``_DistributedOptimizer``, whose methods it holds)."""
    return any(getattr(k, "__module__", "").startswith("horovod.") for k in type(obj).__mro__) or \
        hasattr(obj, "_allreduce_grad_async")


class UpdateSync:
    """Compressed update sync around a local PyTorch optimizer (module docs).

    Args:
        optimizer: the ``torch.optim.Optimizer`` each rank steps on its own gradient (not
            wrapped by ``hvd.DistributedOptimizer``).
        compression: a compressor from ``torch_backend.Compression`` (``Compression.topkc(0.1)``,
            ``from_spec(...)``, rules), or a spec string; default ``"fp16"``. Used by this
            UpdateSync alone (its state is kept per parameter name).
        every: H, optimizer steps between syncs (int >= 1; default 1).
        model: the module whose parameters the optimizer steps, for their names (keys and
            routing rules); refused when it is a ``DistributedDataParallel`` model.
        named_parameters: ``(name, parameter)`` pairs instead of ``model``; with neither, the
            keys are ``group<i>.<j>`` by position in ``optimizer.param_groups``.
        outer_lr, outer_momentum, nesterov: the outer SGD step on the averaged change. Default:
            H = 1: none (``theta + d``); H > 1: lr 0.7, momentum 0.9, Nesterov (DiLoCo).
        backend: ``"horovod"``, ``"torch"`` or None: Horovod when ``hvd.init()`` was called,
            else ``torch.distributed`` when its default group is initialized.
        group: the ``torch.distributed`` process group (backend ``"torch"``; None: the default).
        overlap: post each round's all-reduce without waiting and apply it one sync point
            later (module docs; default False).
        fragments: F, with ``overlap``: parameter fragments synced in turn, one every
            ``every / F`` steps (int >= 1 dividing ``every``; default 1).
        eager: with ``overlap``: True (default) keeps the rank's own change in its parameters
            until the mean replaces it; False restarts the fragment from the applied mean.

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer or is Horovod's; ``compression`` is a
            factory (``Compression.fp16`` without the call) or not a PyTorch compressor.
        ValueError: the other refusals of the module docs, neither backend initialized, or a
            parameter of the optimizer that ``model``/``named_parameters`` does not name.
    """

    def __init__(self, optimizer, compression="fp16", every=1, model=None, named_parameters=None,
                 outer_lr=None, outer_momentum=None, nesterov=True, backend=None, group=None,
                 overlap=False, fragments=1, eager=True):
        if not isinstance(optimizer, torch.optim.Optimizer):
            hint = (" UpdateSync synchronises the parameters itself: use it instead of "
                    "hvd.DistributedOptimizer, never inside it" if isinstance(optimizer, (list, tuple)) else "")
            raise TypeError(f"UpdateSync: expected a torch.optim.Optimizer, got {type(optimizer).__name__}.{hint}")
        if _is_horovod_optimizer(optimizer):
            raise TypeError("UpdateSync: the optimizer is wrapped by hvd.DistributedOptimizer, which "
                            "all-reduces the gradients, and UpdateSync would then sync the parameters "
                            "too (two synchronisations); pass the plain optimizer")
        from torch.nn.parallel import DistributedDataParallel
        if isinstance(model, DistributedDataParallel):
            raise ValueError("UpdateSync: the model is a DistributedDataParallel model, whose backward "
                             "all-reduces the gradients, and UpdateSync would then sync the parameters "
                             "too (two synchronisations); pass the plain module (ddp_model.module) "
                             "without DDP")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"UpdateSync: every must be an integer >= 1 (optimizer steps between "
                             f"syncs), got {every!r}")
        if not isinstance(overlap, bool):
            raise ValueError(f"UpdateSync: overlap must be True or False, got {overlap!r}")
        if not isinstance(fragments, int) or isinstance(fragments, bool) or fragments < 1 or every % fragments:
            raise ValueError(f"UpdateSync: fragments must be an integer >= 1 that divides every={every} "
                             f"(a fragment is synced every every/fragments steps), got {fragments!r}")
        if fragments > 1 and not overlap:
            raise ValueError(f"UpdateSync: fragments={fragments} needs overlap=True (fragments are synced "
                             f"in turn, each overlapped with the next steps)")
        if not isinstance(eager, bool):
            raise ValueError(f"UpdateSync: eager must be True or False, got {eager!r}")
        local = every > 1 or outer_lr is not None or outer_momentum is not None
        self.outer_lr = None if not local else float(0.7 if outer_lr is None else outer_lr)
        self.outer_momentum = None if not local else float(0.9 if outer_momentum is None else outer_momentum)
        if local and not self.outer_lr > 0:
            raise ValueError(f"UpdateSync: outer_lr must be > 0, got {outer_lr!r}")
        if local and not 0 <= self.outer_momentum < 1:
            raise ValueError(f"UpdateSync: outer_momentum must be in [0, 1), got {outer_momentum!r}")
        self.nesterov = bool(nesterov) and bool(self.outer_momentum)
        self.optimizer, self.every = optimizer, every
        self.backend = self._backend(backend)
        self.group = group
        self.compressor = self._compressor(compression)
        self._names = self._parameter_names(optimizer, model, named_parameters)
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        if fragments > len(self._params):
            raise ValueError(f"UpdateSync: fragments={fragments} but the optimizer has only "
                             f"{len(self._params)} parameters (a fragment holds whole parameters)")
        self._exchange = Exchange(self.backend, group, self.compressor,
                                  self._params[0].device if self._params else None)
        with torch.no_grad():
            self._exchange.broadcast_(self._names, self._params)
            self._theta = [p.detach().clone() for p in self._params]
        self._outer = None
        if local:
            self._outer = torch.optim.SGD(self._theta, lr=self.outer_lr, momentum=self.outer_momentum,
                                          nesterov=self.nesterov)
        self.overlap, self.fragments, self.eager = overlap, fragments, eager
        self._overlap = None if not overlap else OverlapSchedule(
            self._names, self._params, self._theta, self._outer, self._exchange, fragments, eager)
        self._period = every // fragments  # steps between sync points
        self._drained = True  # overlap: nothing posted and no step since the last drain
        self.local_steps = 0  # step() calls since the last sync (or sync point)
        self.steps = 0        # step() calls in all (skipped AMP steps included)
        self.syncs = 0        # syncs (and sync points) so far

    # ---- construction checks ----
    def _backend(self, backend):
        if backend is None:
            if _horovod_initialized():
                return _HOROVOD
            if _torch_initialized():
                return _TORCH
            raise ValueError("UpdateSync: neither Horovod (hvd.init()) nor torch.distributed "
                             "(init_process_group) is initialized; initialize one first")
        if backend not in (_HOROVOD, _TORCH):
            raise ValueError(f"UpdateSync: backend must be 'horovod', 'torch' or None, got {backend!r}")
        if backend == _HOROVOD and not _horovod_initialized():
            raise ValueError("UpdateSync: backend='horovod' but hvd.init() has not been called")
        if backend == _TORCH and not _torch_initialized():
            raise ValueError("UpdateSync: backend='torch' but torch.distributed is not initialized")
        return backend

    def _compressor(self, compression):
        from .compression import Compression
        if isinstance(compression, str):
            compression = Compression.from_spec(compression)
        check_compressor(compression, "UpdateSync", "torch.distributed" if self.backend == _TORCH else "Horovod",
                         unbound=False)
        if compression.routes():
            raise ValueError(f"UpdateSync: compressor {compression.spec!r} has already compressed "
                             f"tensors {sorted(compression.routes())[:3]}...; give UpdateSync a compressor "
                             f"of its own (its state is kept per parameter name)")
        if self.backend == _TORCH:
            from .engine import ProcessGroupEngine
            compression.codec.bind_engine(ProcessGroupEngine(self.group))
        elif compression.engine is not None:
            raise ValueError(f"UpdateSync: compressor {compression.spec!r} is bound to "
                             f"{compression.engine!r}; give UpdateSync a compressor of its own")
        return compression

    @staticmethod
    def _parameter_names(optimizer, model, named_parameters):
        if model is not None and named_parameters is not None:
            raise ValueError("UpdateSync: pass model or named_parameters, not both")
        pairs = list(model.named_parameters() if model is not None else named_parameters or [])
        by_id = {id(p): n for n, p in pairs}
        names, seen = [], set()
        for gi, g in enumerate(optimizer.param_groups):
            for j, p in enumerate(g["params"]):
                name = by_id.get(id(p)) if pairs else f"group{gi}.{j}"
                if name is None:
                    raise ValueError(f"UpdateSync: the optimizer's parameter {j} of group {gi} (shape "
                                     f"{list(p.shape)}) is not among the named parameters given; pass "
                                     f"the model whose parameters the optimizer steps")
                if p.is_sparse or not p.dtype.is_floating_point:
                    raise ValueError(f"UpdateSync: parameter {name!r} is {'sparse' if p.is_sparse else p.dtype}; "
                                     f"only dense floating-point parameters can be synced")
                if name in seen:
                    raise ValueError(f"UpdateSync: parameter {name!r} appears twice in the optimizer")
                seen.add(name)
                names.append(name)
        return names

    # ---- the optimizer's face ----
    @property
    def param_groups(self):
        """The inner optimizer's parameter groups (learning-rate schedules act on them)."""
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # GradScaler.step(sync) then calls step() on every iteration, with ``grad_scale`` and
    # ``found_inf`` set on this object, instead of skipping the call on a rank that found an
    # inf (torch.amp.GradScaler's protocol for optimizers that handle the scaling themselves)
    _step_supports_amp_scaling = True

    def step(self, closure=None):
        """The inner optimizer's step on this rank's gradient; every ``every``-th call (every
        ``every / fragments``-th with ``overlap``), then a sync. Returns the closure's loss
        (None without one).

        Under ``scaler.step(sync)`` (AMP, module docs) the call comes with the scaler's
        ``found_inf`` and ``grad_scale``: a step whose gradient has an inf or NaN on this rank
        is skipped here, and still counts (the sync comes at the same call on every rank);
        otherwise the gradient is unscaled and the inner optimizer steps. An inner optimizer
        that handles the scaling itself (``fused=True``) gets both attributes instead, without
        a host read; else the flag is read on the host, as ``GradScaler`` itself does."""
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        if found_inf is None and grad_scale is None:
            loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        else:
            loss = self._scaled_step(found_inf, grad_scale)
        self.local_steps += 1
        self.steps += 1
        self._drained = False
        if self.local_steps >= self._period:
            if self._overlap is None:
                self.synchronize()
            else:
                self._overlap.sync_point(self.syncs + 1, self.steps)
                self.local_steps = 0
                self.syncs += 1
        return loss

    def _scaled_step(self, found_inf, grad_scale):
        inner = self.optimizer
        if getattr(inner, "_step_supports_amp_scaling", False):
            inner.grad_scale, inner.found_inf = grad_scale, found_inf
            try:
                return inner.step()
            finally:
                del inner.grad_scale, inner.found_inf
        if found_inf is not None and bool(found_inf.item()):  # GradScaler's own host read
            return None
        if grad_scale is not None:
            with torch.no_grad():
                inv = grad_scale.double().reciprocal().float()
                for p in self._params:
                    if p.grad is not None:
                        p.grad.mul_(inv.to(p.grad.device))
        return inner.step()

    # ---- the sync ----
    def world(self):
        """``(size, rank)`` of the ranks this UpdateSync syncs over."""
        return self._exchange.world()

    @property
    def theta(self):
        """The synced parameters (one tensor per parameter of the optimizer, in its order):
        equal on every rank after each sync or applied round."""
        return list(self._theta)

    @property
    def in_flight(self):
        """True while an overlapped round is posted and not yet applied."""
        return self._overlap is not None and self._overlap.in_flight

    @torch.no_grad()
    def synchronize(self):
        """Sync now (module docs): every rank's parameters become the new ``theta``. Called by
        :meth:`step` every ``every`` steps (without ``overlap``); call it on every rank alike
        (e.g. after the last step when that is not a multiple of ``every``, before an
        evaluation or a save). With ``overlap``, it applies the round in flight and syncs every
        fragment's remaining change, blocking. With no step since the last sync (and no round
        in flight) it changes nothing (the outer momentum does not move ``theta`` on a zero
        change) and only checks the counts: a rank that skipped a ``step()`` raises here
        instead of leaving its peers blocked.

        Raises:
            ValueError: on every rank alike, before any payload collective: a rank is in
                ``hvd.join()``, the ranks' sync numbers or step counts differ (module docs),
                or what the compressor refuses (a shape change under one key, ...).
        """
        if self._drained if self._overlap is not None else self.local_steps == 0:
            self._exchange.check_counts(self.syncs + 1, self.steps)
            return
        if self._overlap is not None:
            self._overlap.drain(self.syncs + 1, self.steps)
            self._drained = True
        else:
            ex = self._exchange
            ex.check_counts(self.syncs + 1, self.steps)
            posted, _ = ex.post(self._names, self._params, self._theta)
            means = ex.collect(posted)
            t0 = time.perf_counter()
            apply_means(self._theta, means, self._outer)
            for p, theta in zip(self._params, self._theta):
                p.copy_(theta)
            ex.times["decode_s"] += time.perf_counter() - t0
        self.local_steps = 0
        self.syncs += 1

    # ---- reporting ----
    def timings(self) -> dict:
        """Cumulative seconds since construction: ``encode_s`` (computing the changes and
        compressing them), ``decode_s`` (decompressing, the outer step, writing
        ``theta``) and ``comm_s`` (posting and waiting for the all-reduces, the count check)."""
        return dict(self._exchange.times)

    def bytes_per_sync(self) -> StepBytes:
        """Bytes each rank hands to the all-reduces per sync: the compressor's
        ``bytes_per_step()`` (plus the count check's ``24 x size`` bytes, not counted)."""
        return self.compressor.bytes_per_step()

    def bytes_per_step(self) -> StepBytes:
        """:meth:`bytes_per_sync` per optimizer step (divided by ``every``, rounded down)."""
        b = self.bytes_per_sync()
        return StepBytes(*(v // self.every for v in b))

    # ---- checkpoints ----
    def state_dict(self) -> dict:
        """This rank's part of an exact resume (module docs): ``{"every", "local_steps",
        "syncs", "names", "theta": {name: CPU tensor}, "compressor": its per-rank
        ``state_dict()``, "outer": the outer SGD's ``state_dict()`` or None, "optimizer": the
        inner optimizer's ``state_dict()``, "rank", "world_size", "steps", "overlap": None or
        the schedule's state}``.

        With ``overlap``, the round in flight is first waited for and decoded (on every rank:
        call it on every rank alike); its mean is saved unapplied and applied at the next sync
        point, as in the run without the save."""
        size, rank = self.world()
        overlap = None
        if self._overlap is not None:
            self._overlap.settle()
            overlap = dict(self._overlap.state_dict(), drained=self._drained, fragments_count=self.fragments,
                           eager=self.eager)
        return {"every": self.every, "local_steps": self.local_steps, "syncs": self.syncs,
                "steps": self.steps, "overlap": overlap, "names": list(self._names),
                "theta": {n: t.detach().cpu().clone() for n, t in zip(self._names, self._theta)},
                "compressor": self.compressor.state_dict(),
                # copies: an optimizer's state_dict() holds its live state tensors
                "outer": None if self._outer is None else copy.deepcopy(self._outer.state_dict()),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()), "rank": rank, "world_size": size}

    @torch.no_grad()
    def load_state_dict(self, state):
        """Restore :meth:`state_dict` of this rank (the model's parameters are restored by the
        caller, from the model's own ``state_dict``).

        Raises:
            ValueError: another ``every``, other parameter names or shapes, an outer optimizer
                where there is none (or the reverse), another ``overlap``, ``fragments`` or
                ``eager``, or the state of another rank or world size (the residuals are per
                rank).
        """
        size, rank = self.world()
        if state.get("every") != self.every:
            raise ValueError(f"UpdateSync.load_state_dict: saved with every={state.get('every')}, "
                             f"this one has every={self.every}")
        if (state.get("rank"), state.get("world_size")) != (rank, size):
            raise ValueError(f"UpdateSync.load_state_dict: the state of rank {state.get('rank')} of "
                             f"{state.get('world_size')} cannot resume rank {rank} of {size} (its "
                             f"residuals are that rank's own)")
        if list(state.get("names") or []) != self._names:
            raise ValueError(f"UpdateSync.load_state_dict: saved for parameters {state.get('names')}, "
                             f"this one syncs {self._names}")
        if (state.get("outer") is None) != (self._outer is None):
            raise ValueError("UpdateSync.load_state_dict: the saved state and this UpdateSync differ "
                             "in having an outer optimizer (every > 1 or outer_lr/outer_momentum given)")
        overlap = state.get("overlap")
        theirs = None if overlap is None else (overlap["fragments_count"], overlap["eager"])
        mine = None if self._overlap is None else (self.fragments, self.eager)
        if theirs != mine:
            what = lambda o: "no overlap" if o is None else f"overlap with fragments={o[0]}, eager={o[1]}"
            raise ValueError(f"UpdateSync.load_state_dict: saved with {what(theirs)}, this one has {what(mine)}")
        for name, theta in zip(self._names, self._theta):
            saved = state["theta"][name]
            if tuple(saved.shape) != tuple(theta.shape):
                raise ValueError(f"UpdateSync.load_state_dict: parameter {name!r} was saved with shape "
                                 f"{list(saved.shape)}, is {list(theta.shape)}")
            theta.copy_(saved.to(theta.device, theta.dtype))
        self.compressor.load_state_dict(state["compressor"], rank=rank)
        if self._outer is not None:
            self._outer.load_state_dict(state["outer"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.local_steps, self.syncs = int(state["local_steps"]), int(state["syncs"])
        self.steps = int(state.get("steps", self.syncs * self.every + self.local_steps))
        if self._overlap is not None:
            self._overlap.load_state_dict(overlap)
            self._drained = bool(overlap["drained"])

    # ---- torch.distributed's Join: refused ----
    def join_hook(self, **kwargs):
        """``torch.distributed.algorithms.Join([sync])`` calls this: refused (module docs)."""
        raise ValueError("UpdateSync does not support uneven inputs (torch.distributed's Join): a "
                         "joined rank would add a zero change to the average; give every rank the "
                         "same number of steps")

    @property
    def join_device(self):
        return self._params[0].device if self._params else torch.device("cpu")

    @property
    def join_process_group(self):
        return self.group

    def __repr__(self):
        overlap = f", overlap=True, fragments={self.fragments}, eager={self.eager}" if self.overlap else ""
        return (f"UpdateSync({type(self.optimizer).__name__}, compression={self.compressor.spec!r}, "
                f"every={self.every}{overlap}, backend={self.backend!r})")
