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
name as the tensor key (:meth:`~hvd_gradcomp.adapter.HorovodCompressor.encode`, so routing
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

**Checkpoints.** :meth:`state_dict` holds this rank's part of an exact resume: the synced
parameters ``theta``, the steps since the last sync, the compressor's state (its residuals:
per rank), the outer optimizer's state and the inner optimizer's state. Save it on every rank
with the model's ``state_dict()`` (between syncs with H > 1 the local parameters differ from
``theta``); :meth:`load_state_dict` restores it on the same rank.

**Refused** with a ValueError/TypeError, before any collective and alike on every rank: an
optimizer wrapped by ``hvd.DistributedOptimizer`` or an ``UpdateSync`` wrapped by it, a DDP
model (both would all-reduce the gradients as well: two synchronisations), a compressor that
has already compressed tensors or is bound to another engine, blocking two-round variants on
``torch.distributed`` (their side all-reduce is Horovod's), non-float or sparse parameters,
``every`` < 1 and outer options out of range. **Uneven inputs** are refused, not handled: with
Horovod, a rank inside ``hvd.join()`` contributes zeros to the sync's all-reduces, which would
average in a zero change, so every sync first sums one count per rank (a 4-byte all-reduce)
and the ranks still training raise a ValueError naming it; ``torch.distributed``'s ``Join``
context refuses UpdateSync as a joinable (:meth:`join_hook`). Give every rank the same number of
steps instead (e.g. drop the last incomplete batches).
"""
import copy
import time

import torch

from hvd_gradcomp.base import StepBytes

from .compression import check_compressor

__all__ = ["UpdateSync"]

_HOROVOD, _TORCH = "horovod", "torch"


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

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer or is Horovod's; ``compression`` is a
            factory (``Compression.fp16`` without the call) or not a PyTorch compressor.
        ValueError: the other refusals of the module docs, neither backend initialized, or a
            parameter of the optimizer that ``model``/``named_parameters`` does not name.
    """

    def __init__(self, optimizer, compression="fp16", every=1, model=None, named_parameters=None,
                 outer_lr=None, outer_momentum=None, nesterov=True, backend=None, group=None):
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
        with torch.no_grad():
            self._broadcast()
            self._theta = [p.detach().clone() for p in self._params]
        self._outer = None
        if local:
            self._outer = torch.optim.SGD(self._theta, lr=self.outer_lr, momentum=self.outer_momentum,
                                          nesterov=self.nesterov)
        self.local_steps = 0  # optimizer steps since the last sync
        self.syncs = 0
        self._times = {"encode_s": 0.0, "decode_s": 0.0, "comm_s": 0.0}

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
            compression.bind_engine(ProcessGroupEngine(self.group))
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

    def step(self, closure=None):
        """The inner optimizer's step on this rank's gradient; every ``every``-th call, then
        :meth:`synchronize`. Returns the closure's loss (None without one)."""
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.local_steps += 1
        if self.local_steps >= self.every:
            self.synchronize()
        return loss

    # ---- the sync ----
    def world(self):
        """``(size, rank)`` of the ranks this UpdateSync syncs over."""
        if self.backend == _HOROVOD:
            import horovod.torch as hvd
            return hvd.size(), hvd.rank()
        import torch.distributed as dist
        return dist.get_world_size(self.group), dist.get_rank(self.group)

    def _broadcast(self):
        """Rank 0's parameters on every rank."""
        if self.backend == _HOROVOD:
            import horovod.torch as hvd
            for name, p in zip(self._names, self._params):
                hvd.broadcast_(p.data, root_rank=0, name=f"update_sync.init.{name}")
        else:
            import torch.distributed as dist
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            for p in self._params:
                dist.broadcast(p.data, src=src, group=self.group)

    def _check_present(self, size):
        """Horovod: one count per rank, summed; fewer than ``size`` means a rank is in
        ``hvd.join()`` (it contributes zeros): refused (module docs)."""
        if self.backend != _HOROVOD:
            return
        import horovod.torch as hvd
        t0 = time.perf_counter()
        present = int(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="update_sync.present").item())
        self._times["comm_s"] += time.perf_counter() - t0
        if present != size:
            raise ValueError(f"UpdateSync: only {present} of {size} ranks took part in sync "
                             f"{self.syncs + 1}: a rank has called hvd.join() (uneven inputs). A joined "
                             f"rank would add a zero change to the average; UpdateSync does not support "
                             f"uneven inputs: give every rank the same number of steps")

    def _post(self, payload, name):
        if self.backend == _HOROVOD:
            import horovod.torch as hvd
            return hvd.allreduce_async(payload, op=hvd.Sum, name=f"update_sync.{name}")
        import torch.distributed as dist
        return dist.all_reduce(payload, group=self.group, async_op=True), payload

    def _wait(self, handle):
        if self.backend == _HOROVOD:
            import horovod.torch as hvd
            return hvd.synchronize(handle)
        work, payload = handle
        work.wait()
        return payload

    @torch.no_grad()
    def synchronize(self):
        """Sync now (module docs): every rank's parameters become the new ``theta``. Called by
        :meth:`step` every ``every`` steps; call it on every rank alike (e.g. after the last
        step when that is not a multiple of ``every``).

        Raises:
            ValueError: a rank is in ``hvd.join()`` (module docs), or what the compressor
                refuses (a shape change under one key, ...); before any payload collective.
        """
        size, _ = self.world()
        self._check_present(size)
        comp, posted = self.compressor, []
        for name, p, theta in zip(self._names, self._params, self._theta):
            t0 = time.perf_counter()
            delta = p.detach().float() - theta.float()
            payload, ctx = comp.encode(delta, name, op="sum", group=self.group if self.backend == _TORCH else None)
            t1 = time.perf_counter()
            posted.append((self._post(payload, name), ctx, p, theta))
            self._times["encode_s"] += t1 - t0
            self._times["comm_s"] += time.perf_counter() - t1
        for handle, ctx, p, theta in posted:
            t0 = time.perf_counter()
            summed = self._wait(handle)
            t1 = time.perf_counter()
            mean = comp.decode(summed, ctx, divide=size).reshape(theta.shape)
            if self._outer is None:
                theta.add_(mean.to(theta.dtype))
            else:
                theta.grad = (-mean).to(theta.dtype)
            self._times["comm_s"] += t1 - t0
            self._times["decode_s"] += time.perf_counter() - t1
        if self._outer is not None:
            t0 = time.perf_counter()
            self._outer.step()
            for theta in self._theta:
                theta.grad = None
            self._times["decode_s"] += time.perf_counter() - t0
        for p, theta in zip(self._params, self._theta):
            p.copy_(theta)
        self.local_steps = 0
        self.syncs += 1

    # ---- reporting ----
    def timings(self) -> dict:
        """Cumulative seconds since construction: ``encode_s`` (computing the changes and
        compressing them), ``decode_s`` (decompressing, the outer step, writing
        ``theta``) and ``comm_s`` (posting and waiting for the all-reduces, the join check)."""
        return dict(self._times)

    def bytes_per_sync(self) -> StepBytes:
        """Bytes each rank hands to the all-reduces per sync: the compressor's
        ``bytes_per_step()`` (plus, on Horovod, the 4-byte join check, not counted)."""
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
        inner optimizer's ``state_dict()``, "rank", "world_size"}``."""
        size, rank = self.world()
        return {"every": self.every, "local_steps": self.local_steps, "syncs": self.syncs,
                "names": list(self._names),
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
                where there is none (or the reverse), or the state of another rank or world
                size (the residuals are per rank).
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
        return (f"UpdateSync({type(self.optimizer).__name__}, compression={self.compressor.spec!r}, "
                f"every={self.every}, backend={self.backend!r})")
