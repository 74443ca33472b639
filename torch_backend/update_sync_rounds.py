"""The rounds of :class:`torch_backend.update_sync.UpdateSync`: its collectives
(:class:`Exchange`) and the overlapped schedule (:class:`OverlapSchedule`).

**Counts.** Every round first sums one row per rank, ``[1, round number, steps]``, in a
``size x 3`` float64 all-reduce (rank r writes row r, the other rows are zero: an all-gather
by a sum, which Horovod's ``hvd.join()`` also takes part in, with zeros). Each rank then knows
every rank's round number and step count, and every rank raises the same ValueError when they
differ or a rank is missing, before any payload is posted: a rank that skipped a ``step()``
or called ``synchronize()`` alone is named instead of pairing its change with another step's
(or leaving its peers blocked in a collective until the process group's timeout).

**Overlap** (opt-in; Streaming DiLoCo, arXiv 2501.18512; eager updates, arXiv 2502.12996;
the one-round-late outer step of PCCL's async DiLoCo, arXiv 2505.14065). The parameters are
split into F fragments (contiguous in the optimizer's order, balanced by size). A sync point
comes every H / F steps; at sync point j each rank

1. checks the counts (above);
2. waits for the all-reduce posted at sync point j - 1 (fragment g) and decodes its mean;
3. posts the compressed change of fragment ``f = j mod F`` since that fragment's last post,
   ``delta_r = p_r - anchor_r``, without waiting (``anchor_r <- p_r``);
4. applies the mean of step 2 to fragment g's synced parameters ``theta_g`` (the outer step
   of the module docs of ``update_sync``): ``theta_g`` is equal on every rank after it.

The rank's own local parameters of fragment g then follow one of two rules:

- ``eager=True`` (default): the rank's own change ``delta_r`` stood in for the mean while it
  was in flight; now it is replaced by the mean: ``p_r <- p_r + (theta_g' - theta_g) -
  delta_r`` (and the anchor likewise). What the rank learned while the round was in flight is
  kept; ``p_r - theta_g`` is then exactly this rank's change not yet in any applied mean.
  (Eager updates mix the rank's fresh change into the outer step; ours keeps it beside the
  synced parameters until the mean arrives, so the synced parameters stay equal on every
  rank.)
- ``eager=False`` (naive delayed): ``p_r <- theta_g'`` and the anchor too: every rank's
  parameters of fragment g are equal after each applied round; the steps taken on fragment g
  while its round was in flight are dropped (with F = 1: the next round starts from the
  parameters of one round before).

:meth:`OverlapSchedule.drain` (``UpdateSync.synchronize``) waits for the round in flight,
applies it, and syncs every fragment's remaining change, blocking: every rank's parameters
are then equal. :meth:`OverlapSchedule.settle` (``UpdateSync.state_dict``) waits for the round
in flight and decodes it without applying it, so a checkpoint holds its mean and the resumed
run applies it at the same sync point as the uninterrupted one.
"""
import time

import torch

__all__ = ["Exchange", "OverlapSchedule", "apply_means", "fragments_of"]

HOROVOD, TORCH = "horovod", "torch"


class Exchange:
    """The collectives of one UpdateSync, on Horovod or a ``torch.distributed`` group, around
    its compressor (used only through ``encode``/``decode``).

    ``times`` accumulates seconds: ``encode_s`` (changes and compression), ``decode_s``
    (decompression, outer steps, writing parameters: added by the callers) and ``comm_s``
    (posting, waiting, the count check)."""

    def __init__(self, backend, group, compressor, device=None):
        self.backend, self.group, self.compressor = backend, group, compressor
        # the count table's device: the parameters' on torch.distributed (NCCL takes only
        # CUDA tensors), the CPU on Horovod
        self.device = torch.device("cpu") if backend == HOROVOD or device is None else torch.device(device)
        self.times = {"encode_s": 0.0, "decode_s": 0.0, "comm_s": 0.0}

    def world(self):
        """``(size, rank)``."""
        if self.backend == HOROVOD:
            import horovod.torch as hvd
            return hvd.size(), hvd.rank()
        import torch.distributed as dist
        return dist.get_world_size(self.group), dist.get_rank(self.group)

    def broadcast_(self, names, params):
        """Rank 0's ``params`` on every rank."""
        if self.backend == HOROVOD:
            import horovod.torch as hvd
            for name, p in zip(names, params):
                hvd.broadcast_(p.data, root_rank=0, name=f"update_sync.init.{name}")
            return
        import torch.distributed as dist
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for p in params:
            dist.broadcast(p.data, src=src, group=self.group)

    def check_counts(self, number, steps, what="sync"):
        """Every rank's ``[present, number, steps]`` by one blocking all-reduce (module docs).

        Raises:
            ValueError: on every rank alike: a rank is in ``hvd.join()`` (it contributes zeros:
                "only k of n ranks took part in sync N"), or the ranks' round numbers or step
                counts differ (each rank's named).
        """
        size, rank = self.world()
        mine = torch.zeros(size, 3, dtype=torch.float64)
        mine[rank] = torch.tensor([1.0, float(number), float(steps)], dtype=torch.float64)
        rows = mine.to(self.device)
        t0 = time.perf_counter()
        if self.backend == HOROVOD:
            import horovod.torch as hvd
            rows = hvd.allreduce(rows, op=hvd.Sum, name="update_sync.counts")
        else:
            import torch.distributed as dist
            dist.all_reduce(rows, group=self.group)
        self.times["comm_s"] += time.perf_counter() - t0
        rows = [[int(v) for v in row] for row in rows.tolist()]  # the one host read of a sync
        present = sum(row[0] for row in rows)
        if present != size:
            raise ValueError(f"UpdateSync: only {present} of {size} ranks took part in {what} {number}: a rank "
                             f"has called hvd.join() (uneven inputs). A joined rank would add a zero change to "
                             f"the average; UpdateSync does not support uneven inputs: give every rank the "
                             f"same number of steps")
        if len({(row[1], row[2]) for row in rows}) > 1:
            where = ", ".join(f"rank {r}: {what} {row[1]} after {row[2]} steps" for r, row in enumerate(rows))
            raise ValueError(f"UpdateSync: the ranks are at different {what}s ({where}); every rank must call "
                             f"step() and synchronize() alike. Under AMP pass the UpdateSync itself to "
                             f"scaler.step(sync), which counts a skipped step on every rank "
                             f"(docs/update-sync.md, AMP)")

    def post(self, names, params, anchors, keep=False):
        """Encode ``p - anchor`` (float32) of each parameter under its name and post its
        all-reduce at once (Horovod's ``allreduce_async``, or ``all_reduce(async_op=True)``).
        Returns ``(posted, deltas)``: the handles for :meth:`collect`, and with ``keep`` copies
        of the float32 changes (the overlapped schedule's eager rule; a copy, as a payload may
        be the change itself, summed in place), else None."""
        codec, posted, deltas = self.compressor.codec, [], []
        group = self.group if self.backend == TORCH else None
        for name, p, anchor in zip(names, params, anchors):
            t0 = time.perf_counter()
            delta = p.detach().float() - anchor.float()
            payload, ctx = codec.encode(delta, name, op="sum", group=group)
            t1 = time.perf_counter()
            if keep:
                deltas.append(delta.clone())
            posted.append((self._post(payload, name), ctx, tuple(p.shape)))
            self.times["encode_s"] += t1 - t0
            self.times["comm_s"] += time.perf_counter() - t1
        return posted, (deltas if keep else None)

    def collect(self, posted):
        """Wait for each handle of :meth:`post` and decode the ranks' mean change (float32,
        the parameter's shape), in the order posted."""
        size, _ = self.world()
        means = []
        for handle, ctx, shape in posted:
            t0 = time.perf_counter()
            summed = self._wait(handle)
            t1 = time.perf_counter()
            means.append(self.compressor.codec.decode(summed, ctx, divide=size).reshape(shape))
            self.times["comm_s"] += t1 - t0
            self.times["decode_s"] += time.perf_counter() - t1
        return means

    def _post(self, payload, name):
        if self.backend == HOROVOD:
            import horovod.torch as hvd
            return hvd.allreduce_async(payload, op=hvd.Sum, name=f"update_sync.{name}")
        import torch.distributed as dist
        return dist.all_reduce(payload, group=self.group, async_op=True), payload

    def _wait(self, handle):
        if self.backend == HOROVOD:
            import horovod.torch as hvd
            return hvd.synchronize(handle)
        work, payload = handle
        work.wait()
        return payload


def apply_means(thetas, means, outer):
    """The outer step on the synced parameters ``thetas`` with the mean changes ``means``:
    ``theta + mean`` without an outer optimizer, else ``outer.step()`` with gradient
    ``-mean`` on these parameters only (SGD skips parameters without a gradient)."""
    if outer is None:
        for theta, mean in zip(thetas, means):
            theta.add_(mean.to(theta.dtype))
        return
    for theta, mean in zip(thetas, means):
        theta.grad = (-mean).to(theta.dtype)
    outer.step()
    for theta in thetas:
        theta.grad = None


def fragments_of(params, count):
    """Split parameter indices ``0..len(params)-1`` into ``count`` contiguous non-empty
    fragments of about equal numbers of elements (Streaming DiLoCo's fragments)."""
    sizes = [p.numel() for p in params]
    total, bounds, acc, start = sum(sizes), [], 0, 0
    for i, n in enumerate(sizes):
        acc += n
        left_params, left_cuts = len(sizes) - i - 1, count - len(bounds) - 1
        if left_cuts == 0:
            break
        if acc * count >= total * (len(bounds) + 1) or left_params == left_cuts:
            bounds.append(list(range(start, i + 1)))
            start = i + 1
    bounds.append(list(range(start, len(sizes))))
    return bounds


class OverlapSchedule:
    """The overlapped rounds of an UpdateSync (module docs): its fragments, the round in
    flight, the anchors (each parameter's value at its fragment's last post, shifted by the
    eager rule) and the fragment whose turn is next.

    Args: ``names``, ``params`` (the local parameters), ``thetas`` (the synced ones),
    ``outer`` (the outer SGD or None), ``exchange`` (:class:`Exchange`), ``fragments`` (F),
    ``eager`` (bool)."""

    def __init__(self, names, params, thetas, outer, exchange, fragments, eager):
        self.names, self.params, self.thetas, self.outer = names, params, thetas, outer
        self.exchange, self.eager = exchange, eager
        self.fragments = fragments_of(params, fragments)
        self.anchors = [t.detach().clone() for t in thetas]
        self.turn = 0            # the fragment posted at the next sync point
        self._flight = None      # (fragment, posted handles, own float32 changes)
        self._ready = None       # (fragment, means, own changes): waited and decoded, not applied

    @property
    def in_flight(self):
        """True while a posted round has not been applied."""
        return self._flight is not None or self._ready is not None

    def settle(self):
        """Wait for the round in flight and decode it (not applied: the next sync point
        applies it); nothing when none is."""
        if self._flight is not None:
            frag, posted, deltas = self._flight
            self._flight = None
            self._ready = (frag, self.exchange.collect(posted), deltas)

    def _take(self):
        self.settle()
        ready, self._ready = self._ready, None
        return ready

    def _post(self, frag):
        idx = self.fragments[frag]
        posted, deltas = self.exchange.post([self.names[i] for i in idx], [self.params[i] for i in idx],
                                            [self.anchors[i] for i in idx], keep=self.eager)
        for i in idx:
            self.anchors[i].copy_(self.params[i].detach())
        return posted, deltas

    def _apply(self, ready):
        frag, means, deltas = ready
        t0 = time.perf_counter()
        idx = self.fragments[frag]
        thetas = [self.thetas[i] for i in idx]
        before = [t.detach().float().clone() for t in thetas] if self.eager else None
        apply_means(thetas, means, self.outer)
        for k, i in enumerate(idx):
            p, anchor, theta = self.params[i], self.anchors[i], self.thetas[i]
            if self.eager:  # the own change gives way to the mean; later progress is kept
                shift = theta.float() - before[k] - deltas[k]
                p.copy_((p.float() + shift).to(p.dtype))
                anchor.copy_((anchor.float() + shift).to(anchor.dtype))
            else:
                p.copy_(theta)
                anchor.copy_(theta)
        self.exchange.times["decode_s"] += time.perf_counter() - t0

    @torch.no_grad()
    def sync_point(self, number, steps):
        """Steps 1-4 of the module docs; ``number``/``steps``: this round's counts."""
        self.exchange.check_counts(number, steps)
        ready = self._take()
        frag = self.turn
        posted, deltas = self._post(frag)
        self._flight = (frag, posted, deltas)
        self.turn = (self.turn + 1) % len(self.fragments)
        if ready is not None:
            self._apply(ready)

    @torch.no_grad()
    def drain(self, number, steps):
        """Apply the round in flight, then sync every fragment's remaining change at once,
        blocking: ``p = theta = anchor`` on every rank after it."""
        self.exchange.check_counts(number, steps)
        ready = self._take()
        posted, _ = self.exchange.post(self.names, self.params, self.anchors)
        means = self.exchange.collect(posted)
        if ready is not None:
            self._apply(ready)
        t0 = time.perf_counter()
        apply_means(self.thetas, means, self.outer)
        for p, anchor, theta in zip(self.params, self.anchors, self.thetas):
            p.copy_(theta)
            anchor.copy_(theta)
        self.exchange.times["decode_s"] += time.perf_counter() - t0

    # ---- checkpoints ----
    def state_dict(self):
        """``{"turn", "anchors": [CPU tensors], "ready": None or {"fragment", "means",
        "deltas"}}``; call :meth:`settle` first (a posted round cannot be saved)."""
        assert self._flight is None, "settle() first"
        ready = None
        if self._ready is not None:
            frag, means, deltas = self._ready
            ready = {"fragment": frag, "means": [m.detach().cpu().clone() for m in means],
                     "deltas": None if deltas is None else [d.detach().cpu().clone() for d in deltas]}
        return {"turn": self.turn, "fragments": [list(f) for f in self.fragments],
                "anchors": [a.detach().cpu().clone() for a in self.anchors], "ready": ready}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` (a round in flight here is dropped unapplied).

        Raises:
            ValueError: other fragments than this schedule's."""
        if [list(f) for f in state["fragments"]] != [list(f) for f in self.fragments]:
            raise ValueError(f"UpdateSync.load_state_dict: saved with fragments {state['fragments']}, "
                             f"this one has {self.fragments}")
        for anchor, saved in zip(self.anchors, state["anchors"]):
            anchor.copy_(saved.to(anchor.device, anchor.dtype))
        self.turn, self._flight, self._ready = int(state["turn"]), None, None
        ready = state.get("ready")
        if ready is not None:
            dev = [self.params[i].device for i in self.fragments[ready["fragment"]]]
            deltas = ready["deltas"]
            self._ready = (int(ready["fragment"]), [m.to(d) for m, d in zip(ready["means"], dev)],
                           None if deltas is None else [x.to(d) for x, d in zip(deltas, dev)])
