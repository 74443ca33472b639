"""``python -m hvd_gradcomp.bench tta``: time-to-accuracy sweep over an emulated slow network.

What it does, in three steps (``main`` only wires them):

1. Plan (:func:`plan_sweep`): for each workload (``--workloads``; default ``digits``), one
   Horovod run per compressor spec (``--compressors``; default: FP32, FP16, TopK, TopKC, the
   THC variants and the PowerSGD variants, whichever are registered in
   :data:`hvd_gradcomp.registry.SCHEMES`), plus, for PyTorch workloads, ``torch.distributed``
   DDP runs with its built-in hooks (``--ddp-hooks``; default ``fp16_compress_hook`` and
   ``powerSGD_hook``), labelled as such, and, for the LM workloads, FSDP2 (HSDP) runs on a
   ``--fsdp-mesh`` of replicas x shards (``--fsdp-hooks``, default off; FP16-FSDP, FSDP's own
   float16 collectives, first: it sets their target; the others compress the all-reduce across
   replicas, :func:`parse_fsdp_hooks`); then one *no-communication reference* per workload
   (``--no-comm-reference``, default on): the same FP32 Horovod training with the network
   left out, i.e. on an unthrottled loopback link instead of the rate-limited one, the limit
   any compressor can approach (labelled as a reference, never a baseline or a "best" row);
   the link and the output folder. With ``--repeats N`` every run is
   planned N times, interleaved: round 1 of every row, then round 2, ..., so that all rows
   see the same background load over the sweep (the same seed in every round: the repeats
   measure the timing noise). Nothing runs yet.
2. Run (:func:`run_sweep`): sets up the network (:mod:`.netem`): one namespace per worker,
   veth links rate-limited to ``--bandwidth`` Mbit/s (optional ``--latency``) to a bridge
   (with FSDP rows one namespace per replica: its ranks' traffic among themselves unthrottled,
   ``--ranks-per-host``);
   without root it falls back to loopback and says so in every output. The link is verified
   with a timed all-reduce against the ring model (:mod:`.linkcheck`, ``--link-factor``); a
   link that misses stops the sweep. Then starts the workload's worker module
   (:mod:`.workers`, as ``python -m hvd_gradcomp.bench.workers.<name>``) on the ranks
   (:mod:`.launch`: Horovod's rendezvous server, or torch.distributed variables for DDP),
   with a progress bar fed by rank 0's ``@tta`` lines. Each run trains to its target and a
   fixed number of epochs past it, or until its caps. Tears the network down (always:
   ``finally``, Ctrl-C and SIGTERM included).
3. Report (:func:`report_sweep`): writes to ``--out`` (default ``runs/tta-<time>`` under the
   current directory): ``results.json`` (everything: sweep metadata with versions, git
   commit, network and link check; every run's records), ``runs.csv`` (one row per run, with
   its ``repeat``), ``summary.csv`` (one row per table row: medians and spread over the
   repeats), ``steps.csv``/``evals.csv``, ``tta_<workload>.png`` plots (repeats: median curve
   and min-max band) and ``summary.md``; prints the summary table (:mod:`.report` defines its
   columns).

``--update-doc FILE`` then rewrites the table and plot block between
``<!-- tta-demo:start/end -->`` in FILE, with the same code as ``python -m hvd_gradcomp.bench
publish --results <out>/results.json --update-doc FILE`` (:mod:`.publish`), which re-renders
the block later from the saved results without a new sweep.

Default bandwidth, 500 Mbit/s per worker link: the digits model's FP32 gradient is 17.4 MB,
so at 500 Mbit/s FP32 communication takes about 0.35 s a step and FP16 about 0.17 s, against
roughly 0.05 s of compute on one core per worker: communication dominates, as on a GPU
cluster with a fast network and a large model, while the whole default sweep takes a few
minutes. Its measured duration, and how closely the namespaces carry each rate:
docs/tta.md ("The network").
"""
import argparse
import datetime
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

from typing import NamedTuple, Optional

from . import device, fp16_estimate, launch, linkcheck, netem, publish, report, report_plot, report_table
from .worker import PROGRESS_PREFIX

__all__ = ["main", "plan_sweep", "run_sweep", "report_sweep", "SweepPlan", "SweepOutcome",
           "default_specs", "parse_compressors", "plan_runs", "interleave", "RunSpec", "WORKLOADS",
           "NOCOMM_SPEC", "NOCOMM_LABEL", "network_for", "Row", "parse_row", "parse_update_sync",
           "note_fp16", "stop_flags", "ADAM_ROWS", "FP16_TTA_CAP", "delay_support"]

# workload key -> (framework, worker module, workload name inside the worker, DDP-capable)
WORKLOADS = {
    "digits": ("torch", "hvd_gradcomp.bench.workers.digits_torch", "digits", True),
    "lm": ("torch", "hvd_gradcomp.bench.workers.lm_torch", "lm", True),
    "lm-comm": ("torch", "hvd_gradcomp.bench.workers.lm_comm_torch", "lm-comm", True),
    "digits-tf": ("tensorflow", "hvd_gradcomp.bench.workers.digits_tf", "digits", False),
    "digits-tf-eager": ("tensorflow", "hvd_gradcomp.bench.workers.digits_tf", "digits-eager", False),
}
# Worker flags of a workload: digits-tf-eager runs every row's step eagerly, so that auto
# (eager only) is compared with the fixed compressors in the same execution mode.
WORKLOAD_FLAGS = {"digits-tf-eager": ("--eager",)}
DDP_WORKER = "hvd_gradcomp.bench.workers.ddp_torch"  # every DDP run, whatever the workload
# FSDP rows (``--fsdp-hooks``): HSDP on a (replicate, shard) mesh, on these workloads only (the
# worker shards the transformer's layers). Their baseline, FP16-FSDP, is the row ``fp16``:
# FSDP's own collectives in float16 (workers.fsdp_torch); it sets the FSDP rows' target.
FSDP_WORKER = "hvd_gradcomp.bench.workers.fsdp_torch"
FSDP_WORKLOADS = ("lm", "lm-comm")
FSDP_BASELINE = "fp16"
# Candidate defaults, in table order; those naming an unregistered scheme or option are skipped.
DEFAULT_CANDIDATES = (
    "none", "fp16", "topk:ratio=0.1",
    "topkc:ratio=0.1",  # single collective: selection by the previous step's agreed scores
    "topkc:ratio=0.1,selection=current",  # the paper's two rounds (blocking score all-reduce)
    "thc",  # single collective: saturation, partial rotation (10 stages), 4 bits, lagged ranges
    "thc:rotation=full,saturation=false,range=current",  # THC's simple adaptation (blocking)
    "powersgd:rank=4",  # single collective: alternating factors (ACP-SGD)
    "powersgd:rank=4,variant=two_round",  # Vogels et al.'s two rounds (blocking P all-reduce)
)
DEFAULT_DDP_HOOKS = "fp16;powersgd:rank=4"
# lm-comm's default rows (issue 34), all under the users' recipe (AdamW, warm-up and cosine
# decay: workers.torch_workloads.LMCommWorkload): FP16 (the baseline, it sets the target), what
# users do instead of compressing (gradient accumulation over 4 micro-batches; local steps:
# DiLoCo-style update sync every 8 steps, the averaged change in FP16), the gradient compressors,
# (THC also without error feedback, the better THC under AdamW, and with lanes for the other
# rank, fewer bytes at 2 ranks; and 4 levels a rank, 7x fewer bytes at 2 ranks: docs/adam.md), and
# compressed update sync every step (each rank steps AdamW on its own gradient; the
# compressed parameter change is averaged: torch_backend.update_sync). A row is "SPEC" or "SPEC
# with CLAUSE[ with CLAUSE]" (:func:`parse_row`). Rows whose spec this checkout cannot build run
# as failed rows that say why (:class:`RunSpec` ``unavailable``).
ADAM_ROWS = (
    "fp16", "fp16 with accumulate(4)", "fp16 with update-sync(every=8)",
    "thc", "thc:error_feedback=false", "thc:error_feedback=false,subtract_own=true",
    "thc:bits=2,error_feedback=false,subtract_own=true", "thc:bits=1",
    "thc:bits=3 with accumulate(2)",
    "topkc:ratio=0.1", "topkc:ratio=0.1,residual_decay=0.95", "powersgd:rank=8",
    "topkc:ratio=0.1 with update-sync(every=1)",
)
# The rows of issue 25's sweep (Adam 2e-3 constant: ``--recipe adam-constant``), kept for comparison.
ADAM_ROWS_ISSUE25 = (
    "fp16", "thc", "topkc:ratio=0.1", "powersgd:rank=4", "auto",
    "topkc:ratio=0.1,error_feedback=ef21,fp16_warmup=100",
    "powersgd:rank=4,error_feedback=ef21,fp16_warmup=100",
    "topkc:ratio=0.1 with frozen-adamw(weight_decay=0,freeze_step=100)",
    "powersgd:rank=4 with frozen-adamw(weight_decay=0,freeze_step=100)",
)
# Sweep defaults of a workload, used when every workload of the sweep has them and the
# option is not given. lm-comm: a 50 Mbit/s link (FP16's step mostly communication), no
# training-clock cap (its fixed step budget ends every run), no DDP rows, no reference.
WORKLOAD_SWEEP_DEFAULTS = {
    "lm-comm": {"bandwidth": 50.0, "max_seconds": 0.0, "compressors": ADAM_ROWS,
                "ddp_hooks": "off", "no_comm_reference": "off"},
}
# Workloads whose target is relative to FP16 (the worker's ``target_vs_fp16``): once the
# FP16 row (Horovod, the workload's own optimizer) has run its step budget, every later row of
# the workload stops when it reaches that target (factor x FP16's final rolling metric), or
# when its training clock passes this many times FP16's TTA (``--tta-cap``), so that a row
# needing more steps than FP16 is still measured as long as it can still win or tie on time,
# while rows that reach the target sooner do not run on. The report measures every row against
# the same target again (report.apply_targets), from the saved evaluations.
FP16_TTA_CAP = {"lm-comm": 1.5}
# Workloads whose worker takes ``--recipe`` (the sweep's ``--recipe`` is passed on).
RECIPE_WORKLOADS = ("lm-comm",)
SWEEP_DEFAULTS = {"bandwidth": 500.0, "max_seconds": 120.0, "compressors": None,
                  "ddp_hooks": DEFAULT_DDP_HOOKS, "no_comm_reference": "on"}
# The no-communication reference: FP32 (Horovod's own path) on an unthrottled loopback link.
NOCOMM_SPEC = "none"
NOCOMM_LABEL = "no communication (reference: fp32, unthrottled)"
DEFAULT_BANDWIDTH_MBIT = 500.0


class RunSpec:
    """One planned run: workload key, system ("horovod"/"ddp"), spec, label, run id, and its
    round ``repeat`` (1-based) of ``repeats``; the run id ends in ``-r<repeat>`` only when
    ``repeats`` > 1 (``row_id``: the id without it, shared by the row's repeats).

    ``reference=True`` marks the no-communication reference: a Horovod FP32 run (spec
    :data:`NOCOMM_SPEC`) on an unthrottled loopback link (:func:`network_for`), label
    :data:`NOCOMM_LABEL`, row id ``<workload>-horovod-none-nocomm``.

    ``optimizer``: the row's optimizer text (``adamw(lr=1e-3)``, passed to the worker as
    ``--optimizer``; None: the workload's own). ``accumulate``: micro-batches per optimizer
    step and all-reduce (``--accumulate``; 1: none). ``update_sync``: the options of compressed
    update sync (``every=8``, passed as ``--update-sync``; None: the gradient all-reduce).
    ``groups``: Horovod's ``num_groups`` (``--num-groups``; 0: none, one all-reduce and one codec
    call per tensor). They join the label (``SPEC with accumulate(4)``, ``SPEC with groups(1)``,
    ``SPEC with update-sync(every=8)``, ``SPEC with OPT``, in this order: :meth:`Row.text`) and
    the row id. ``unavailable``: why this checkout
    cannot run the row (it is then reported as failed, ``not run: <why>``, without a launch).

    FSDP rows (``system="fsdp"``, :func:`parse_fsdp_hooks`): ``spec`` compresses the all-reduce
    across replicas (``fp16``: FP16-FSDP, FSDP's own float16 collectives; ``none``: its float32
    ones), ``reduce_scatter`` the reduce-scatter within the shard group (None: FSDP's own),
    ``overlap`` installs the hook with ``overlap=True``; label :func:`fsdp_label`, row id
    ``<workload>-fsdp-<spec>[-with-rs-<spec>][-with-overlap]``.

    ``delay``: D >= 1 on a DDP row of ours (spec ``ours:<spec>``, from a ``SPEC with delay(D)``
    row): the hook registered with ``delay=D`` (delayed gradient sync; ``--delay D``), label
    ``SPEC with delay(D) on DDP``.
    """

    def __init__(self, workload, system, spec, label=None, repeat=1, repeats=1, reference=False,
                 optimizer=None, unavailable=None, accumulate=1, update_sync=None, reduce_scatter=None,
                 overlap=False, groups=0, delay=0):
        self.workload, self.system, self.spec = workload, system, spec
        self.reduce_scatter = reduce_scatter or None  # FSDP rows: the reduce-scatter's spec
        self.overlap = bool(overlap)  # FSDP rows: install(..., overlap=True)
        self.reference = bool(reference)
        self.optimizer = optimizer or None
        self.accumulate = int(accumulate or 1)
        self.update_sync = update_sync
        self.groups = int(groups or 0)
        self.delay = int(delay or 0)  # DDP rows of ours: register_comm_hook(..., delay=D)
        self.unavailable = unavailable
        self.framework = WORKLOADS[workload][0]
        tail = Row(spec, self.optimizer, self.accumulate, update_sync, self.groups, self.delay).text()[len(spec):]
        self.label = label or (NOCOMM_LABEL if self.reference else
                               {"none": "fp32 (none)"}.get(spec, spec) if system == "horovod" else f"DDP {spec}")
        if tail and not label:
            self.label += tail
        if system == "fsdp" and not label:
            self.label = fsdp_label(spec, self.reduce_scatter, self.overlap)
        if self.reduce_scatter:
            tail += f" with rs={self.reduce_scatter}"
        if self.overlap:
            tail += " with overlap"
        slug = re.sub(r"[^A-Za-z0-9]+", "-", spec + tail).strip("-")
        self.row_id = f"{workload}-{system}-{slug}" + ("-nocomm" if self.reference else "")
        self.repeat, self.repeats = repeat, repeats
        self.run_id = self.row_id if repeats == 1 else f"{self.row_id}-r{repeat}"

    def again(self, repeat, repeats):
        """This run as round ``repeat`` of ``repeats`` (:func:`interleave`)."""
        return RunSpec(self.workload, self.system, self.spec, self.label, repeat, repeats, self.reference,
                       self.optimizer, self.unavailable, self.accumulate, self.update_sync,
                       self.reduce_scatter, self.overlap, self.groups, self.delay)

    def __repr__(self):
        return f"RunSpec({self.run_id})"


def _check_spec(spec):
    """Parse ``spec`` as the workers' ``Compression.from_spec`` does (a compressor spec, so
    the routing option ``min_numel`` is accepted) and build its schemes (framework-free), so
    bad values fail here, not in a worker. Raises ValueError naming the problem."""
    from hvd_gradcomp.routing import Routing
    Routing.from_spec(spec)


def default_specs():
    """The default compressor specs that the registry can build right now, and the skipped ones."""
    ok, skipped = [], []
    for spec in DEFAULT_CANDIDATES:
        try:
            _check_spec(spec)
        except ValueError as e:
            skipped.append((spec, str(e).split(";")[0]))
        else:
            ok.append(spec)
    return ok, skipped


class Row(NamedTuple):
    """A parsed row of ``--compressors`` (:func:`parse_row`)."""

    spec: str
    optimizer: Optional[str] = None  # NAME(k=v,...) text; None: the workload's own
    accumulate: int = 1  # micro-batches per optimizer step and all-reduce
    update_sync: Optional[str] = None  # update-sync options ("every=8"); None: off
    groups: int = 0  # Horovod's num_groups; 0: none
    delay: int = 0  # delayed gradient sync (the DDP hook's delay=D); 0: none

    def text(self):
        """The canonical row: ``SPEC[ with accumulate(K)][ with groups(G)][ with
        update-sync(...)][ with delay(D)][ with OPT]``."""
        parts = [self.spec]
        if self.accumulate > 1:
            parts.append(f"accumulate({self.accumulate})")
        if self.groups:
            parts.append(f"groups({self.groups})")
        if self.update_sync is not None:
            parts.append(f"update-sync({self.update_sync})")
        if self.delay:
            parts.append(f"delay({self.delay})")
        if self.optimizer:
            parts.append(self.optimizer)
        return " with ".join(parts)


_ACCUMULATE = re.compile(r"^accumulate\s*\((.*)\)$")
_GROUPS = re.compile(r"^groups\s*\((.*)\)$")
_UPDATE_SYNC = re.compile(r"^update-sync\s*(?:\((.*)\))?$")
_DELAY = re.compile(r"^delay\s*\((.*)\)$")
# Row options of update sync -> type (torch_backend.update_sync.UpdateSync's arguments).
UPDATE_SYNC_OPTIONS = {"every": int, "outer_lr": float, "outer_momentum": float, "nesterov": bool,
                       "overlap": bool, "fragments": int, "eager": bool}


def parse_update_sync(body):
    """``"every=8,outer_lr=0.7"`` -> ``{"every": 8, "outer_lr": 0.7}``: the options of
    ``torch_backend.update_sync.UpdateSync`` a row may give (:data:`UPDATE_SYNC_OPTIONS`:
    ``every`` int >= 1, ``outer_lr`` > 0, ``outer_momentum`` in [0, 1), ``nesterov``
    true/false; the overlapped sync (docs/update-sync.md): ``overlap`` true/false, ``fragments``
    int >= 1 dividing ``every`` (default 1), ``eager`` true/false); ``""`` -> ``{}``.

    Raises:
        ValueError: an unknown option, or a value of the wrong type or range (named):
            ``fragments`` that do not divide ``every``, ``fragments`` > 1 or ``eager`` without
            ``overlap=true`` (UpdateSync's own rules, checked here so a row fails at planning).
    """
    out = {}
    for item in (x.strip() for x in (body or "").split(",")):
        if not item:
            continue
        key, eq, val = (x.strip() for x in item.partition("="))
        kind = UPDATE_SYNC_OPTIONS.get(key)
        if kind is None or not eq or not val:
            raise ValueError(f"update-sync: expected key=value with key one of "
                             f"{sorted(UPDATE_SYNC_OPTIONS)}, got {item!r}")
        try:
            if kind is bool:
                if val.lower() not in ("true", "false"):
                    raise ValueError(val)
                out[key] = val.lower() == "true"
            else:
                out[key] = kind(val)
        except ValueError:
            raise ValueError(f"update-sync: option {key} must be {'true/false' if kind is bool else kind.__name__}, "
                             f"got {val!r}") from None
    if out.get("every", 1) < 1:
        raise ValueError(f"update-sync: every must be >= 1, got {out['every']}")
    if out.get("outer_lr", 1.0) <= 0:
        raise ValueError(f"update-sync: outer_lr must be > 0, got {out['outer_lr']}")
    if not 0 <= out.get("outer_momentum", 0.0) < 1:
        raise ValueError(f"update-sync: outer_momentum must be in [0, 1), got {out['outer_momentum']}")
    every, frags = out.get("every", 1), out.get("fragments", 1)
    if frags < 1 or every % frags:
        raise ValueError(f"update-sync: fragments must be an integer >= 1 that divides every={every} "
                         f"(a fragment is synced every every/fragments steps), got {frags}")
    for key in ("fragments", "eager"):
        if key in out and not out.get("overlap", False):
            raise ValueError(f"update-sync: {key}={str(out[key]).lower()} needs overlap=true "
                             f"(fragments and the eager rule belong to the overlapped sync)")
    return out


def parse_row(text):
    """``"topkc:ratio=0.1 with frozen-adamw(freeze_step=100)"`` -> ``Row("topkc:ratio=0.1",
    "frozen-adamw(freeze_step=100)")``.

    A row is ``SPEC`` followed by ``with CLAUSE`` clauses, each kind at most once:
    ``accumulate(K)`` (K >= 1 micro-batches of the usual size per optimizer step and
    all-reduce), ``groups(G)`` (G >= 1: Horovod's ``num_groups``, the gradients all-reduced in G
    groups, each compressed as one bucket per route: one codec call per group and route),
    ``update-sync(every=H,...)`` (compressed update sync instead of the gradient all-reduce,
    :func:`parse_update_sync`; ``update-sync`` alone: every=1), ``delay(D)`` (D >= 1:
    delayed gradient sync, step t's mean applied at step t + D: the row runs on DDP with our
    hook, ``torch_backend.ddp.register_comm_hook(..., delay=D)``, :func:`delay_support`), or an
    optimizer ``NAME(k=v,...)`` (:func:`hvd_gradcomp.bench.worker.parse_optimizer`). ``fp32``
    means ``none``. Only the clauses' syntax is checked here, not the spec.

    Raises:
        ValueError: an empty spec, a bad or repeated clause, accumulate or groups with
            update-sync (update sync already communicates once per ``every`` steps, through its
            own all-reduces), or delay with accumulate, groups or update-sync (a delayed row
            runs on DDP's hook, which has neither).
    """
    from .worker import parse_optimizer
    parts = [x.strip() for x in text.split(" with ")]
    spec = parts[0]
    if not spec:
        raise ValueError(f"expected a compressor spec before 'with', got {text!r}")
    def count(match, name, letter, seen):
        """The integer >= 1 of an ``accumulate(K)``/``groups(G)`` clause, given once."""
        if seen is not None:
            raise ValueError(f"row {text!r}: {name} given twice")
        k = match.group(1).strip()
        if not k.isdigit() or int(k) < 1:
            raise ValueError(f"row {text!r}: {name}({letter}) takes an integer {letter} >= 1, got {k!r}")
        return int(k)

    opt = accumulate = sync = groups = delay = None
    for clause in parts[1:]:
        m, u, g = _ACCUMULATE.match(clause), _UPDATE_SYNC.match(clause), _GROUPS.match(clause)
        d = _DELAY.match(clause)
        if d:
            delay = count(d, "delay", "D", delay)
        elif g:
            groups = count(g, "groups", "G", groups)
        elif m:
            accumulate = count(m, "accumulate", "K", accumulate)
        elif u:
            if sync is not None:
                raise ValueError(f"row {text!r}: update-sync given twice")
            opts = dict({"every": 1}, **parse_update_sync(u.group(1)))
            sync = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in opts.items())
        elif clause:
            if opt is not None:
                raise ValueError(f"row {text!r}: a second optimizer clause {clause!r}")
            parse_optimizer(clause)
            opt = clause
    if (accumulate or 1) > 1 and sync is not None:
        raise ValueError(f"row {text!r}: accumulate and update-sync together are not supported "
                         f"(update-sync(every=H) already communicates once per H steps)")
    if groups is not None and sync is not None:
        raise ValueError(f"row {text!r}: groups and update-sync together are not supported "
                         f"(update sync all-reduces the parameter changes itself, not through "
                         f"hvd.DistributedOptimizer's groups)")
    if delay is not None:
        other = [name for name, v in (("accumulate", accumulate), ("groups", groups), ("update-sync", sync))
                 if v is not None]
        if other:
            raise ValueError(f"row {text!r}: delay and {other[0]} together are not supported (a delay(D) "
                             f"row runs on DDP with our hook, which has no {other[0]})")
    return Row("none" if spec == "fp32" else spec, opt, accumulate or 1, sync, groups or 0, delay or 0)


def delay_support():
    """None when this checkout's DDP hook takes ``delay=`` (``torch_backend.ddp``'s
    ``register_comm_hook`` has a ``delay`` parameter, read from its source without importing
    torch), else why not (a ``delay(D)`` row is then planned as not run, with that reason)."""
    import ast
    import importlib.util
    try:
        spec = importlib.util.find_spec("torch_backend.ddp")
    except (ImportError, ValueError) as e:
        return f"torch_backend.ddp cannot be found ({e})"
    if spec is None or not spec.origin:
        return "torch_backend.ddp cannot be found"
    with open(spec.origin) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "register_comm_hook":
            a = node.args
            if any(x.arg == "delay" for x in a.args + a.kwonlyargs):
                return None
            return ("this checkout's torch_backend.ddp.register_comm_hook has no delay= option "
                    "(delayed gradient sync, issue 49 item 1, is not built here yet)")
    return "torch_backend.ddp has no register_comm_hook"


def parse_compressors(text):
    """``"fp16; topkc:ratio=0.01,chunk=256"`` -> list of rows (``;`` separates rows).

    Each row is a spec, optionally ``SPEC with OPTIMIZER(k=v,...)`` (:func:`parse_row`); each
    spec is parsed and its config built (:func:`_check_spec`); ``fp32`` means ``none``. A row
    without an optimizer is returned as its spec, one with as ``SPEC with OPTIMIZER``.

    Raises:
        ValueError: an empty list, or a spec the registry rejects (its message says why).
    """
    rows = [s.strip() for s in text.split(";") if s.strip()]
    if not rows:
        raise ValueError(f"expected at least one compressor spec, got {text!r}")
    out = []
    for row in rows:
        parsed = parse_row(row)
        _check_spec(parsed.spec)
        out.append(parsed.text())
    return out


def check_rows(rows):
    """``[(row, why or None)]``: each row (:func:`parse_row` syntax) with the reason this
    checkout cannot build its spec (:func:`_check_spec`'s message), None when it can (the
    default row lists: an option other branches add is reported, not fatal)."""
    out = []
    for row in rows:
        try:
            parsed = parse_row(row)
            _check_spec(parsed.spec)
        except ValueError as e:
            out.append((row, str(e)))
        else:
            out.append((parsed.text(), None))
    return out


def parse_ddp_hooks(text):
    """``"fp16;powersgd:rank=4"`` -> list; ``""`` or ``"off"`` -> []. Checked like the worker does."""
    if text.strip().lower() in ("", "off", "no"):
        return []
    hooks = [s.strip() for s in text.split(";") if s.strip()]
    for h in hooks:
        name, _, rest = h.partition(":")
        if name == "ours":  # this project's compressor as a DDP hook (torch_backend.ddp)
            _check_spec(rest)
            continue
        if name not in ("none", "fp32", "fp16", "powersgd") or (name != "powersgd" and rest) or (
                rest and not re.fullmatch(r"rank=\d+", rest)):
            raise ValueError(f"ddp hook must be none, fp16, powersgd:rank=R or ours:<spec>, got {h!r}")
    return hooks


def fsdp_label(spec, reduce_scatter=None, overlap=False):
    """An FSDP row's label: ``FP16-FSDP`` (spec ``fp16``), ``FP32-FSDP`` (``none``) or ``<spec>
    on FSDP``, followed by ``, rs <spec>`` when the reduce-scatter is compressed too and
    ``, overlap`` with ``install(..., overlap=True)`` (the worker's ``label``,
    :mod:`.workers.fsdp_torch`)."""
    out = {"fp16": "FP16-FSDP", "none": "FP32-FSDP"}.get(spec, f"{spec} on FSDP")
    return out + (f", rs {reduce_scatter}" if reduce_scatter else "") + (", overlap" if overlap else "")


def fsdp_compression(spec, reduce_scatter=None, overlap=False):
    """An FSDP run's ``meta.compression``: ``fsdp:<spec>[ with rs=<spec>][ with overlap]`` (the
    worker records the same)."""
    return (f"fsdp:{spec}" + (f" with rs={reduce_scatter}" if reduce_scatter else "")
            + (" with overlap" if overlap else ""))


def parse_fsdp_hooks(text, shards=2):
    """``"fp16; thc; topkc:0.1; fp16 with rs=thc; thc with overlap"`` -> ``[(spec, rs or None,
    overlap), ...]`` (``;`` separates rows; ``""``/``"off"`` -> []). A row is the all-reduce's
    spec across replicas (``fp16``: FP16-FSDP, FSDP's own float16 collectives; ``none``/``fp32``:
    FSDP's own float32 ones; any other: our compressor through ``torch_backend.fsdp.install``),
    optionally ``with rs=SPEC``: the reduce-scatter within the shard group compressed by
    ``install_reduce_scatter``, and ``with overlap``: our hook installed with ``overlap=True``.
    FP16-FSDP (``fp16``), the FSDP rows' baseline, is put first (added when missing, with a note
    on stderr): it sets their target and ratios.

    Args:
        text: the option's value.
        shards: S, ranks per replica of the sweep's mesh (``rs=`` needs S >= 2).

    Raises:
        ValueError: a bad spec (the registry's message); a blocking two-round variant (install
            refuses them); an ``rs=`` spec that cannot be reduce-scattered (named, with why), or
            ``rs=`` with one shard per replica; ``overlap`` on FSDP's own collectives (``fp16``,
            ``none``); an unknown clause; a row given twice.
    """
    if text.strip().lower() in ("", "off", "no"):
        return []
    from hvd_gradcomp.routing import Routing
    out = []
    for row in (x.strip() for x in text.split(";")):
        if not row:
            continue
        parts = [x.strip() for x in row.split(" with ")]
        spec = "none" if parts[0] == "fp32" else parts[0]
        rs, overlap = None, False
        for clause in parts[1:]:
            key, eq, val = (x.strip() for x in clause.partition("="))
            if key == "overlap" and not eq and not overlap:
                overlap = True
                continue
            if key != "rs" or not eq or not val or rs is not None:
                raise ValueError(f"fsdp row {row!r}: expected 'SPEC', 'SPEC with rs=SPEC' or 'SPEC with "
                                 f"overlap', got clause {clause!r}")
            rs = val
        if not spec:
            raise ValueError(f"fsdp row {row!r}: expected a compressor spec before 'with'")
        _check_spec(spec)
        if overlap and spec in (FSDP_BASELINE, "none"):
            raise ValueError(f"fsdp row {row!r}: overlap installs our hook with overlap=True; "
                             f"{spec!r} is FSDP's own all-reduce (overlap needs one of this project's specs, e.g. thc)")
        blocking = [s.spec() for s in Routing.from_spec(spec).schemes() if s.blocking]
        if blocking:
            raise ValueError(f"fsdp row {row!r}: {blocking[0]} is a blocking two-round variant, which "
                             f"torch_backend.fsdp.install refuses (its side all-reduce is Horovod's)")
        if rs is not None:
            _check_spec(rs)
            if shards < 2:
                raise ValueError(f"fsdp row {row!r}: rs= compresses the reduce-scatter within a replica, "
                                 f"but the mesh has one shard per replica (nothing is reduce-scattered)")
            from torch_backend import Compression
            from torch_backend.fsdp_scatter import _scatter_refusal
            for scheme in Compression.from_spec(rs).routing.schemes():
                why = _scatter_refusal(scheme, shards)
                if why is not None:
                    raise ValueError(f"fsdp row {row!r}: rs={rs} routes tensors to {scheme.spec()}, which "
                                     f"cannot be reduce-scattered: {why}")
        if (spec, rs, overlap) in out:
            raise ValueError(f"fsdp row {row!r} given twice")
        out.append((spec, rs, overlap))
    base = (FSDP_BASELINE, None, False)
    if out and base not in out:
        print(f"tta: FSDP rows: FP16-FSDP ({FSDP_BASELINE!r}), their baseline, added first", file=sys.stderr)
    return [base] + [r for r in out if r != base] if out else []


def parse_fsdp_mesh(text, workers):
    """``--fsdp-mesh``: ``"2x2"`` -> ``(2, 2)`` (R replicas x S shards); None or ``""`` ->
    ``(2, workers // 2)``.

    Raises:
        ValueError: not ``RxS``, R < 2, or R x S != ``workers``
            (named).
    """
    r, _, s = (text or "").lower().partition("x")
    if not text:
        if workers < 2 or workers % 2:
            raise ValueError(f"--fsdp-mesh: the default 2 x (workers / 2) needs an even --workers >= 2, "
                             f"got {workers}; give the mesh as RxS")
        return 2, workers // 2
    if not (r.strip().isdigit() and s.strip().isdigit()) or int(r) < 1 or int(s) < 1:
        raise ValueError(f"--fsdp-mesh: expected RxS (replicas x shards, positive integers), got {text!r}")
    r, s = int(r), int(s)
    if r < 2:
        raise ValueError(f"--fsdp-mesh {text}: at least 2 replicas are needed (FSDP rows compress the "
                         f"all-reduce across replicas)")
    if r * s != workers:
        raise ValueError(f"--fsdp-mesh {text}: {r} x {s} = {r * s} ranks, but --workers is {workers}; "
                         f"the workers must divide into the mesh")
    return r, s


def _eager_only(spec: str) -> bool:
    """True if ``spec`` routes some tensor to an adaptive scheme (``auto``: eager only)."""
    from hvd_gradcomp.routing import Routing
    return any(scheme.adaptive for scheme in Routing.from_spec(spec).schemes())


def plan_runs(workloads, specs, ddp_hooks, reference=False, unavailable=None, fsdp_rows=()):
    """The runs in table order: per workload, the Horovod specs, the DDP hooks (PyTorch
    workloads), the FSDP rows (``fsdp_rows``: :func:`parse_fsdp_hooks`'s pairs, FP16-FSDP
    first; on :data:`FSDP_WORKLOADS` only, skipped with a note elsewhere), then, with
    ``reference``, the no-communication reference (FP32 on an unthrottled link,
    :class:`RunSpec` ``reference=True``). Specs with ``auto`` are left out
    of TensorFlow workloads whose step is a ``tf.function`` (auto runs eagerly), with a note;
    ``digits-tf-eager`` runs them. A spec may be a row ``SPEC with OPTIMIZER``
    (:func:`parse_row`); ``unavailable`` maps rows to why they cannot run here (they are
    planned, and reported as failed without a launch).

    Raises:
        ValueError: an unknown workload.
    """
    plan = []
    unavailable = unavailable or {}
    for w in workloads:
        if w not in WORKLOADS:
            raise ValueError(f"unknown workload {w!r}; expected some of {sorted(WORKLOADS)}")
        for row in specs:
            parsed = parse_row(row)
            s = parsed.spec
            why = unavailable.get(row)
            if parsed.delay:  # delayed gradient sync: our hook on DDP (delay_support)
                if not WORKLOADS[w][3]:
                    raise ValueError(f"row {row!r}: delay(D) rows run on DDP, which {w} has not "
                                     f"(PyTorch workloads only)")
                label = Row(s, parsed.optimizer, delay=parsed.delay).text() + " on DDP"
                plan.append(RunSpec(w, "ddp", f"ours:{s}", label, optimizer=parsed.optimizer,
                                    unavailable=why or delay_support(), delay=parsed.delay))
                continue
            if (parsed.accumulate > 1 or parsed.update_sync is not None or parsed.groups) \
                    and WORKLOADS[w][0] != "torch":
                raise ValueError(f"row {row!r}: accumulate, groups and update-sync rows run on the "
                                 f"PyTorch workloads only, not on {w}")
            if why is None and WORKLOADS[w][0] == "tensorflow" and "--eager" not in WORKLOAD_FLAGS.get(w, ()) \
                    and _eager_only(s):
                print(f"tta: {s} skipped on {w}: auto runs eagerly only, and this worker's step "
                      f"is a tf.function (workload digits-tf-eager runs it)", file=sys.stderr)
                continue
            plan.append(RunSpec(w, "horovod", s, optimizer=parsed.optimizer, unavailable=why,
                                accumulate=parsed.accumulate, update_sync=parsed.update_sync,
                                groups=parsed.groups))
        if WORKLOADS[w][3]:
            for h in ddp_hooks:
                name = h.split(":")[0]
                label = {"none": "DDP fp32", "fp32": "DDP fp32", "fp16": "DDP fp16_compress_hook"}.get(
                    name, f"DDP powerSGD_hook {h.partition(':')[2]}".strip())
                if name == "ours":
                    label = f"{h.partition(':')[2]} on DDP"
                plan.append(RunSpec(w, "ddp", h, label))
        if fsdp_rows and w in FSDP_WORKLOADS:
            plan.extend(RunSpec(w, "fsdp", spec, reduce_scatter=rs, overlap=ov) for spec, rs, ov in fsdp_rows)
        elif fsdp_rows:
            print(f"tta: FSDP rows skipped on {w}: they run on {', '.join(FSDP_WORKLOADS)} only", file=sys.stderr)
        if reference:
            plan.append(RunSpec(w, "horovod", NOCOMM_SPEC, reference=True))
    return plan


def interleave(plan, repeats):
    """``plan`` (table order) run ``repeats`` times, interleaved: every run of round 1, then
    of round 2, ... (new :class:`RunSpec` objects with ``repeat``/``repeats`` set).

    Raises:
        ValueError: repeats < 1.
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"--repeats must be an integer >= 1, got {repeats!r}")
    return [r.again(k, repeats) for k in range(1, repeats + 1) for r in plan]


def _git_commit():
    """The commit of the source checkout this package runs from (``-dirty`` when modified);
    None for an installed package (no ``.git`` beside it) or without git."""
    root = launch.IMPORT_ROOT
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def _versions():
    from importlib import metadata
    import platform
    out = {"python": platform.python_version()}
    for dist in ("torch", "horovod", "tensorflow-cpu", "tensorflow", "numpy", "scikit-learn",
                 "matplotlib"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _command(run, args, out_json, extra=()):
    """The command every rank runs: ``python -m <worker module> <flags>`` (never a file path);
    ``extra`` flags (:func:`stop_flags`) go before ``--worker-args``, which can override them."""
    framework, module, wname, _ = WORKLOADS[run.workload]
    cmd = [sys.executable, "-m", {"ddp": DDP_WORKER, "fsdp": FSDP_WORKER}.get(run.system, module)]
    if run.system == "ddp":
        cmd += ["--workload", wname, "--hook", run.spec]
        if run.delay:
            cmd += ["--delay", str(run.delay)]
    elif run.system == "fsdp":
        r, s = getattr(args, "fsdp_mesh_shape", None) or parse_fsdp_mesh(getattr(args, "fsdp_mesh", None), args.workers)
        cmd += ["--workload", wname, "--compression", run.spec, "--mesh", f"{r}x{s}"]
        if run.reduce_scatter:
            cmd += ["--reduce-scatter", run.reduce_scatter]
        if run.overlap:
            cmd += ["--overlap"]
    else:
        cmd += ["--compression", run.spec]
    if run.optimizer:
        cmd += ["--optimizer", run.optimizer]
    if run.accumulate > 1:
        cmd += ["--accumulate", str(run.accumulate)]
    if run.groups:
        cmd += ["--num-groups", str(run.groups)]
    if run.update_sync is not None:
        cmd += ["--update-sync", run.update_sync]
    if getattr(args, "recipe", None) and run.workload in RECIPE_WORKLOADS:
        cmd += ["--recipe", args.recipe]
    cmd += ["--seed", str(args.seed), "--out", out_json, "--progress"]
    if getattr(args, "device", "cpu") != "cpu":
        cmd += ["--device", args.device]
    cmd += list(WORKLOAD_FLAGS.get(run.workload, ())) if run.system == "horovod" else []
    if args.max_seconds:
        cmd += ["--max-seconds", str(args.max_seconds)]
    if getattr(args, "budget_epochs", None):
        cmd += ["--max-epochs", f"{args.budget_epochs:g}"]
    cmd += list(extra)
    cmd += args.worker_args.split() if args.worker_args else []
    return cmd


def _stub_result(run, status, error="", network=None):
    out = {"status": status, "error": error,
           "meta": {"workload": WORKLOADS[run.workload][2], "framework": WORKLOADS[run.workload][0],
                    "system": run.system, "label": run.label, "compression": run.spec,
                    "optimizer": run.optimizer, "accumulate": run.accumulate, "update_sync": run.update_sync,
                    "num_groups": run.groups, "delay": run.delay,
                    "repeat": run.repeat, "reference": run.reference}}
    if run.system == "fsdp":  # as the worker records it (workers.fsdp_torch)
        out["meta"]["compression"] = fsdp_compression(run.spec, run.reduce_scatter, run.overlap)
    if network is not None:
        out["network"] = network
    return out


def _is_fp16_baseline(run):
    """Horovod's FP16 row (the workload's own optimizer, no clause), or FP16-FSDP (the FSDP
    row ``fp16`` with FSDP's own reduce-scatter): the baseline of its :func:`stop_group`."""
    if run.system == "fsdp":
        return run.spec == FSDP_BASELINE and not run.reduce_scatter and not run.optimizer and not run.overlap
    return (run.system == "horovod" and run.spec == "fp16" and not run.optimizer and not run.reference
            and run.accumulate == 1 and run.update_sync is None and not run.groups)


def stop_group(run):
    """The key of ``stops`` (:func:`note_fp16`) that ``run`` belongs to: its workload (Horovod
    and DDP rows, measured against Horovod's FP16), or ``"<workload> fsdp"`` for FSDP rows
    (against FP16-FSDP)."""
    return f"{run.workload} fsdp" if run.system == "fsdp" else run.workload


def note_fp16(run, result, stops, cap=None):
    """After a run: when it is the FP16 baseline (Horovod ``fp16``, the workload's own
    optimizer; for FSDP rows FP16-FSDP) of a workload in :data:`FP16_TTA_CAP` and recorded
    ``target_vs_fp16``, store in ``stops[stop_group(run)]`` (:func:`stop_group`: the workload,
    or ``"<workload> fsdp"``) what the later rows of that group stop at (:func:`stop_flags`): the target
    (factor x its final rolling metric), FP16's TTA to it (``fp16_tta_s``, training clock,
    :func:`.report.time_to_target`), the cap (``cap``, default :data:`FP16_TTA_CAP`'s) and
    ``max_seconds`` = cap x FP16's TTA, and FP16's steps (``fp16_steps``: the learning-rate
    schedule's length for the later rows). The first FP16 run of the sweep sets them (with
    repeats: round 1's)."""
    meta, evals = result.get("meta") or {}, result.get("evals") or {}
    if stop_group(run) in stops or run.workload not in FP16_TTA_CAP or not _is_fp16_baseline(run):
        return
    if result.get("status") != "ok" or not meta.get("target_vs_fp16") or not evals.get("metric"):
        return
    from .worker import rolling_mean
    window = int(meta.get("window", 5))
    final = rolling_mean(evals["metric"], window)[-1]
    target = meta["target_vs_fp16"] * final
    tta_s = report.time_to_target(evals["t"], evals["metric"], target, bool(meta.get("higher_is_better")), window)
    if tta_s is None:  # a factor below 1 (or a higher-is-better metric): FP16 never got there
        tta_s = evals["t"][-1]
    steps = int(meta.get("steps_run") or len((result.get("steps") or {}).get("step", [])))
    factor = FP16_TTA_CAP[run.workload] if cap is None else float(cap)
    early = fp16_estimate.stop_values(result, factor)  # stopped early on a slow link (--fp16-reference)
    if early is not None:
        stops[stop_group(run)] = early
        return
    stops[stop_group(run)] = {"target": target, "fp16_tta_s": tta_s, "cap": factor,
                           "max_seconds": factor * tta_s, "fp16_steps": steps}


def stop_flags(run, stops):
    """Worker flags that stop ``run`` at its workload's FP16-relative target or time cap
    (:func:`note_fp16`): ``--target T --epochs-past-target 0 --max-seconds S --max-epochs 1e9
    --schedule-steps N`` (the training-clock cap S = cap x FP16's TTA, not a step or epoch
    budget, ends it; N = FP16's steps, so the learning-rate schedule is FP16's); none for the
    FP16 baseline itself or before FP16 has run. FSDP rows stop at FP16-FSDP's
    (:func:`stop_group`)."""
    stop = stops.get(stop_group(run))
    if stop is None or _is_fp16_baseline(run):
        return []
    return ["--target", f"{stop['target']:.6g}", "--epochs-past-target", "0",
            "--max-seconds", f"{stop['max_seconds']:.6g}", "--max-epochs", "1e9",
            "--schedule-steps", str(stop["fp16_steps"])]


def network_for(net, run):
    """The network ``run`` goes on: the sweep's ``net``, or for the no-communication
    reference (``run.reference``) a :class:`.netem.LoopbackNetwork` of the same size, which
    needs no set-up: the network left out (no rate limit, no namespaces; the ranks still
    all-reduce, over 127.0.0.1)."""
    if not run.reference:
        return net
    return netem.LoopbackNetwork(net.world_size, "no-communication reference")


def execute(net, run, args, out_dir, progress=True, extra=()):
    """Run one planned run on ``net`` (the reference on :func:`network_for`'s loopback);
    returns its result dict (``status`` "ok" or why not). A reference run's result holds
    its own network's ``describe()`` under ``"network"`` and ``meta["reference"] = True``."""
    if run.unavailable:
        print(f"tta: run {run.run_id} not run: {run.unavailable}", file=sys.stderr)
        return _stub_result(run, f"not run: {run.unavailable}", run.unavailable)
    from tqdm import tqdm
    log_dir = os.path.join(out_dir, "logs", run.run_id)
    os.makedirs(log_dir, exist_ok=True)
    out_json = os.path.join(out_dir, "runs", run.run_id + ".json")
    os.makedirs(os.path.dirname(out_json), exist_ok=True)
    if os.path.exists(out_json):
        os.remove(out_json)
    cmd = _command(run, args, out_json, extra)
    with open(os.path.join(log_dir, "command.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n")
    own = network_for(net, run)
    handle = launch.launch(own, cmd, kind="horovod" if run.system == "horovod" else "ddp",
                           env={**launch.malloc_env(args.malloc),
                                **device.launch_env(getattr(args, "device", "cpu"), own)},
                           log_dir=log_dir, pipe_rank0=True)
    lines = queue.Queue()
    stdout = handle.procs[0].stdout

    def reader():
        for line in stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()
    rnd = f" r{run.repeat}/{run.repeats}" if run.repeats > 1 else ""
    bar = tqdm(total=None, desc=f"{run.workload} {run.label}"[:48 - len(rnd)] + rnd, unit="step", leave=True,
               disable=not progress, file=sys.stderr, dynamic_ncols=True)
    capped = max([float(extra[i + 1]) for i, f in enumerate(extra[:-1]) if f == "--max-seconds"] or [0.0])
    limit = capped or args.max_seconds
    timeout = args.run_timeout or (3 * limit + 300 if limit else 1800)
    deadline = time.monotonic() + timeout
    code, eof = None, False
    with open(os.path.join(log_dir, "rank0.stdout"), "w") as raw:
        try:
            while True:
                try:
                    line = lines.get(timeout=0.2)
                except queue.Empty:
                    line = ""
                if line is None:
                    eof = True
                elif line:
                    if line.startswith(PROGRESS_PREFIX):
                        p = json.loads(line[len(PROGRESS_PREFIX):])
                        bar.total = p["total"]
                        bar.n = p["step"]
                        bar.set_postfix(metric=f"{p['metric']:.4g}", rolling=f"{p['rolling']:.4g}",
                                        clock=f"{p['t']:.0f}s", refresh=False)
                        bar.refresh()
                    else:
                        raw.write(line)
                code = handle.poll()
                if code not in (None, 0) or (code == 0 and eof):
                    break
                if time.monotonic() > deadline:
                    code = 124
                    break
        finally:
            bar.close()
            handle.kill()
            handle.close()
    if code == 0 and os.path.exists(out_json):
        with open(out_json) as f:
            result = json.load(f)
        result["status"] = "ok"
        result["meta"]["label"] = run.label
        result["meta"]["optimizer"] = run.optimizer
        result["meta"]["accumulate"] = run.accumulate
        result["meta"]["update_sync"] = run.update_sync
        result["meta"]["num_groups"] = run.groups
        result["meta"]["delay"] = run.delay
        result["meta"]["repeat"] = run.repeat
        result["meta"]["reference"] = run.reference
        if run.reference:
            result["network"] = own.describe()
        return result
    tail = ""
    for name in sorted(os.listdir(log_dir)):
        if name.startswith("rank"):
            with open(os.path.join(log_dir, name), errors="replace") as f:
                text = f.read()
            tail += f"--- {name} ---\n" + "\n".join(text.strip().splitlines()[-15:]) + "\n"
    status = "timeout" if code == 124 else f"failed (exit {code})"
    print(f"tta: run {run.run_id} {status}; logs in {log_dir}\n{tail}", file=sys.stderr)
    return _stub_result(run, status, tail, own.describe() if run.reference else None)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m hvd_gradcomp.bench tta",
                                description="Time-to-accuracy sweep over an emulated bandwidth-limited network.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workloads", default="digits",
                   help=f"comma-separated, some of {sorted(WORKLOADS)}")
    p.add_argument("--compressors", default=None,
                   help="';'-separated rows: compressor specs, each optionally followed by 'with "
                        "CLAUSE' clauses: an optimizer OPTIMIZER(k=v,...) (adam, adamw, sgd, "
                        "frozen-adamw; e.g. 'topkc:ratio=0.1 with adam(lr=6.3e-3)'), accumulate(K) "
                        "(K micro-batches per all-reduce), groups(G) (Horovod's num_groups: G groups, one "
                        "codec call per group and route), update-sync(every=H,...) (compressed "
                        "update sync, torch_backend.UpdateSync; also overlap=true, fragments=F, "
                        "eager=true/false), delay(D) (delayed gradient sync: the row runs on DDP "
                        "with our hook, register_comm_hook(..., delay=D); reported as not run where "
                        "this checkout's hook has no delay=). Default: every registered "
                        f"default, from {'; '.join(DEFAULT_CANDIDATES)}; for lm-comm alone: "
                        f"{'; '.join(ADAM_ROWS)}. 'off': no Horovod rows (with --ddp-hooks or "
                        "--fsdp-hooks rows). Every scheme's options: python -m hvd_gradcomp --list")
    p.add_argument("--ddp-hooks", default=None,
                   help="';'-separated DDP hooks for PyTorch workloads (none, fp16, powersgd:rank=R); "
                        f"'off' for none (default {DEFAULT_DDP_HOOKS}; lm-comm alone: off)")
    p.add_argument("--fsdp-hooks", default="off",
                   help="';'-separated FSDP rows for the LM workloads (lm, lm-comm): HSDP on the "
                        "--fsdp-mesh, each row the spec of the all-reduce across replicas (fp16: "
                        "FP16-FSDP, FSDP's own float16 collectives, the rows' baseline, always run "
                        "first; none: FSDP's own float32; any other: ours, torch_backend.fsdp.install), "
                        "optionally 'with rs=SPEC' (the reduce-scatter within a replica compressed "
                        "too: none, fp16, bf16, thc, signsgd), e.g. 'fp16;thc;topkc:ratio=0.1;thc "
                        "with rs=thc'; 'off' for none")
    p.add_argument("--fsdp-mesh", default=None, metavar="RxS",
                   help="the FSDP rows' mesh: R replicas of S shards, R x S = --workers (default "
                        "2 x (workers / 2))")
    p.add_argument("--ranks-per-host", type=int, default=None,
                   help="ranks per emulated host (one namespace and rate-limited link each; the "
                        "traffic between a host's ranks is unthrottled): default S of --fsdp-mesh "
                        "when FSDP rows run (the slow link between replicas only), else 1. Every "
                        "row of the sweep runs on this network")
    p.add_argument("--no-comm-reference", choices=("on", "off"), default=None,
                   help="per workload, one more run as a reference, not a competitor: FP32 on an "
                        "unthrottled loopback link (the network left out), the limit any "
                        "compressor can approach (default on; lm-comm alone: off)")
    p.add_argument("--workers", type=int, default=2, help="ranks (one namespace each)")
    device.add_device_arg(p)
    p.add_argument("--bandwidth", type=float, default=None,
                   help=f"Mbit/s per worker link, each direction (default {DEFAULT_BANDWIDTH_MBIT:g}; "
                        f"lm-comm alone: {WORKLOAD_SWEEP_DEFAULTS['lm-comm']['bandwidth']:g})")
    p.add_argument("--latency", type=float, default=0.0, help="one-way latency per worker link, ms")
    p.add_argument("--loopback", action="store_true",
                   help="skip the emulation and run on 127.0.0.1 (also the automatic fallback without root)")
    p.add_argument("--link-factor", type=float, default=2.5,
                   help="the link check allows measured/model time up to this factor")
    p.add_argument("--skip-link-check", action="store_true")
    p.add_argument("--malloc", choices=launch.MALLOC_POLICIES, default="keep",
                   help="glibc malloc policy of every run's ranks, Horovod, DDP and reference "
                        "alike: 'keep' (freed memory is kept, not unmapped, so large tensors are "
                        "not page-faulted in again each step: hvd_gradcomp/bench/launch.py) or "
                        "'system' (the environment as it is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every row this many times, interleaved (round 1 of every row, then "
                        "round 2, ...); the table shows median TTA with its min-max")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="cap on each run's training clock (s); 0 = none (default 120; lm-comm "
                        "alone: 0, its step budget ends every run)")
    p.add_argument("--tta-cap", type=float, default=None,
                   help="workloads whose target is relative to FP16 (lm-comm): every row after FP16 "
                        "stops at the target or when its training clock passes this multiple of "
                        f"FP16's TTA (default {FP16_TTA_CAP['lm-comm']:g})")
    p.add_argument("--fp16-reference", default=None, metavar="RESULTS_JSON",
                   help="a slow link: the results.json of a sweep of the same workload on a faster "
                        "link; FP16's row here stops after --fp16-steps steps and its TTA is its steps "
                        "to target in that sweep times its median step time measured here, labelled "
                        "'est.' (the other rows take that sweep's FP16 target and schedule; "
                        "hvd_gradcomp/bench/fp16_estimate.py)")
    p.add_argument("--fp16-steps", type=int, default=100,
                   help="with --fp16-reference: FP16's steps on this link (its step time's sample)")
    p.add_argument("--budget-epochs", type=float, default=None,
                   help="every run's epoch budget (--max-epochs), before the stop flags: so for "
                        "workloads whose target is relative to FP16 (lm-comm, default 1.75) it sets "
                        "FP16's budget, and the rows after it still run to the target or --tta-cap")
    p.add_argument("--recipe", choices=("adamw-cosine", "adam-constant"), default=None,
                   help="lm-comm's training recipe for every row: adamw-cosine (the default: AdamW "
                        "(0.9, 0.95), weight decay 0.1 on matrices, 5%% linear warm-up, cosine decay "
                        "to 10%%) or adam-constant (issue 25's: Adam, constant 2e-3)")
    p.add_argument("--run-timeout", type=float, default=0.0,
                   help="wall-clock limit per run (s); 0 = 3 x max-seconds + 300")
    p.add_argument("--worker-args", default="",
                   help="extra flags for every worker, e.g. '--max-steps 10 --hidden 256'")
    p.add_argument("--out", default=None, help="output folder (default runs/tta-<time>)")
    p.add_argument("--update-doc", action="append", default=[],
                   help="a Markdown file whose <!-- BLOCK:start/end --> block gets the table and "
                        "plots (repeatable)")
    p.add_argument("--doc-block", default="tta-demo", help="BLOCK name for --update-doc")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _install_sigterm():
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


class SweepPlan(NamedTuple):
    """What a sweep will do, decided before anything runs (:func:`plan_sweep`).

    workloads: workload keys, in order. runs: the :class:`RunSpec` list in the order they run
    (table order; with repeats, round after round, :func:`interleave`).
    skipped: ``(spec, why)`` for default specs the registry cannot build. link: the
    :class:`.netem.LinkConfig` asked for. out_dir: absolute output folder (not yet created).
    fsdp_mesh: ``(R, S)`` of the FSDP rows (None without). ranks_per_host: ranks per emulated
    host (:class:`.netem.EmulatedNetwork`; S of the mesh by default when FSDP rows run).
    """

    workloads: list
    runs: list
    skipped: list
    link: netem.LinkConfig
    out_dir: str
    fsdp_mesh: Optional[tuple] = None  # (R, S) when FSDP rows are planned
    ranks_per_host: int = 1


class SweepOutcome(NamedTuple):
    """What running a plan produced (:func:`run_sweep`).

    results: run id -> result dict (runs not reached are absent). network: the network's
    ``describe()``. link_check: :func:`.linkcheck.verify_link`'s dict, or None when skipped.
    link_failed: the link check stopped the sweep (no run was started). interrupted: Ctrl-C or
    SIGTERM ended it early. stops: per workload with an FP16-relative target, what the rows
    after FP16 stopped at (:func:`note_fp16`).
    """

    results: dict
    network: dict
    link_check: Optional[dict]
    link_failed: bool
    interrupted: bool
    stops: dict = {}


def sweep_defaults(workloads):
    """The defaults of the options left unset (``--bandwidth``, ``--max-seconds``,
    ``--compressors``, ``--ddp-hooks``, ``--no-comm-reference``): :data:`SWEEP_DEFAULTS`,
    overridden by :data:`WORKLOAD_SWEEP_DEFAULTS` when every workload of the sweep has the
    same entry there (``--workloads lm-comm``); a mixed sweep keeps the general ones."""
    out = dict(SWEEP_DEFAULTS)
    own = [WORKLOAD_SWEEP_DEFAULTS.get(w) for w in workloads]
    if own and all(o is not None and o == own[0] for o in own):
        out.update(own[0])
    return out


def plan_sweep(args) -> SweepPlan:
    """Step 1: the runs, specs, link and output folder from parsed options; nothing runs.
    Options left unset (None) are filled in ``args`` from :func:`sweep_defaults`.

    ``--compressors off`` plans no Horovod rows (the sweep then needs DDP or FSDP rows).

    Raises:
        ValueError: an unknown workload, a bad compressor spec, DDP hook or FSDP row, an FSDP
            mesh the workers do not divide into, ``--ranks-per-host`` not dividing the workers,
            a sweep with no rows, or a link setting out of range (the message says which).
    """
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    defaults = sweep_defaults(workloads)
    for key in ("bandwidth", "max_seconds", "ddp_hooks", "no_comm_reference"):
        if getattr(args, key, None) is None:
            setattr(args, key, defaults[key])
    device.check_sweep(args, [WORKLOADS[w][0] for w in workloads if w in WORKLOADS])
    if getattr(args, "budget_epochs", None) is not None and not args.budget_epochs > 0:
        raise ValueError(f"--budget-epochs must be > 0, got {args.budget_epochs:g}")
    if getattr(args, "tta_cap", None) is not None and not args.tta_cap > 0:
        raise ValueError(f"--tta-cap must be > 0 (a multiple of FP16's TTA), got {args.tta_cap:g}")
    args.fp16_reference_rows = None
    if getattr(args, "fp16_reference", None):
        relative = [w for w in workloads if w in FP16_TTA_CAP]
        if not relative:
            raise ValueError(f"--fp16-reference: the estimate is for workloads whose target is relative to "
                             f"FP16 ({', '.join(FP16_TTA_CAP)}); the sweep's are {', '.join(workloads)}")
        fp16_estimate.fp16_flags({"steps": 1}, getattr(args, "fp16_steps", 100))  # checks --fp16-steps
        args.fp16_reference_rows = fp16_estimate.load_reference(args.fp16_reference, relative, args.workers)
    unavailable = {}
    if args.compressors and args.compressors.strip().lower() == "off":
        specs, skipped = [], []
    elif args.compressors:
        specs, skipped = parse_compressors(args.compressors), []
    elif defaults["compressors"] is not None:
        checked = check_rows(defaults["compressors"])
        specs, skipped = [row for row, _ in checked], []
        unavailable = {row: why for row, why in checked if why}
        for row, why in unavailable.items():
            print(f"tta: default row {row!r} cannot run on this checkout ({why.split(';')[0]}); "
                  "it is reported as not run", file=sys.stderr)
    else:
        specs, skipped = default_specs()
    hooks = parse_ddp_hooks(args.ddp_hooks)
    mesh, fsdp_rows = None, []
    if (getattr(args, "fsdp_hooks", None) or "off").strip().lower() not in ("", "off", "no"):
        mesh = parse_fsdp_mesh(getattr(args, "fsdp_mesh", None), args.workers)
        fsdp_rows = parse_fsdp_hooks(args.fsdp_hooks, mesh[1])
        if not any(w in FSDP_WORKLOADS for w in workloads):
            raise ValueError(f"--fsdp-hooks: FSDP rows run on {', '.join(FSDP_WORKLOADS)} only; the sweep's "
                             f"workloads are {', '.join(workloads)}")
    elif getattr(args, "fsdp_mesh", None):
        raise ValueError("--fsdp-mesh is for the FSDP rows; give --fsdp-hooks too")
    args.fsdp_mesh_shape = mesh
    per_host = getattr(args, "ranks_per_host", None)
    if per_host is None:
        per_host = mesh[1] if mesh else 1
    if per_host < 1 or args.workers % per_host:
        raise ValueError(f"--ranks-per-host must be >= 1 and divide --workers {args.workers}, got {per_host}")
    runs = plan_runs(workloads, specs, hooks, reference=args.no_comm_reference == "on",
                     unavailable=unavailable, fsdp_rows=fsdp_rows)
    if not runs:
        raise ValueError("the sweep has no rows: --compressors off needs --ddp-hooks or --fsdp-hooks rows")
    runs = interleave(runs, args.repeats)
    link = netem.LinkConfig(args.bandwidth, args.latency)
    out_dir = os.path.abspath(args.out or os.path.join(
        "runs", "tta-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S")))
    return SweepPlan(workloads, runs, skipped, link, out_dir, mesh, per_host)


def _print_link_check(link_check, factor):
    """One stderr line: the link check's measured time against the ring model (or, on
    loopback, the effective rate only)."""
    if link_check.get("model_seconds"):
        print(f"tta: link check: {link_check['nbytes'] / 2**20:.1f} MiB all-reduce in "
              f"{link_check['seconds']:.3f} s (ring model {link_check['model_seconds']:.3f} s, "
              f"ratio {link_check['ratio']:.2f}, allowed <= {factor:g}); "
              f"effective {link_check['effective_mbit']:.0f} Mbit/s", file=sys.stderr)
    else:
        print(f"tta: link check (loopback, not checked): effective "
              f"{link_check['effective_mbit']:.0f} Mbit/s", file=sys.stderr)


def run_sweep(plan: SweepPlan, args) -> SweepOutcome:
    """Step 2: build the network, check the link, run every planned run, tear the network down.

    Creates ``plan.out_dir`` (each run writes its records and logs there). The network is
    torn down in every case (``finally``: a failed link check, Ctrl-C and SIGTERM included).
    Progress and warnings go to stderr.
    """
    for spec, why in plan.skipped:
        print(f"tta: skipping default compressor {spec!r} ({why})", file=sys.stderr)
    os.makedirs(plan.out_dir, exist_ok=True)
    net = netem.make_network(args.workers, plan.link, loopback=args.loopback, ranks_per_host=plan.ranks_per_host)
    if net.mode == "loopback":
        print(f"tta: WARNING: running on LOOPBACK ({net.reason}); no rate limit, communication is "
              "nearly free, and every output says so.", file=sys.stderr)
    previous = _install_sigterm()
    results, link_check, stops = {}, None, {}
    interrupted = link_failed = False
    try:
        net.setup()
        desc = net.describe()
        print(f"tta: {desc['note']}; malloc {args.malloc}; {len(plan.runs)} runs: {', '.join(r.run_id for r in plan.runs)}",
              file=sys.stderr)
        if not args.skip_link_check:
            try:
                link_check = linkcheck.verify_link(net, factor=args.link_factor)
            except netem.LinkError as e:
                print(f"tta: {e}", file=sys.stderr)
                link_failed = True
            else:
                _print_link_check(link_check, args.link_factor)
        if not link_failed:
            refs = getattr(args, "fp16_reference_rows", None) or {}
            for run in plan.runs:
                ref = refs.get(run.workload) if run.system == "horovod" and _is_fp16_baseline(run) else None
                extra = fp16_estimate.fp16_flags(ref, args.fp16_steps) if ref else stop_flags(run, stops)
                results[run.run_id] = execute(net, run, args, plan.out_dir, progress=not args.no_progress,
                                              extra=extra)
                if ref:  # FP16 stopped early: its TTA is estimated (fp16_estimate)
                    results[run.run_id].setdefault("meta", {})["fp16_estimate"] = \
                        fp16_estimate.reference_meta(ref, args.fp16_steps)
                elif extra:  # what stopped it, for the report (report_table.stop_note)
                    results[run.run_id].setdefault("meta", {})["stop_cap"] = dict(stops[stop_group(run)])
                note_fp16(run, results[run.run_id], stops, getattr(args, "tta_cap", None))
    except KeyboardInterrupt:
        interrupted = True
        print("tta: interrupted; tearing down and writing what finished", file=sys.stderr)
    finally:
        net.teardown()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    desc = dict(net.describe(), malloc=args.malloc)
    return SweepOutcome(results, desc, link_check, link_failed, interrupted, stops)


def report_sweep(plan: SweepPlan, args, outcome: SweepOutcome, argv, t_start):
    """Step 3: write ``results.json``, the CSVs, the plots and ``summary.md``; print the table.

    Args:
        plan, args, outcome: the sweep's plan, options and outcome.
        argv: the command-line arguments (recorded in ``results.json``; None: ``sys.argv[1:]``).
        t_start: ``time.time()`` when the sweep started.

    ``--update-doc`` is done afterwards from the saved ``results.json`` (:func:`publish.publish`).
    """
    desc, results, link_check = outcome.network, outcome.results, outcome.link_check
    commit = _git_commit()
    sweep = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": list(argv or sys.argv[1:]),
             "git_commit": commit, "versions": _versions(), "cpu_count": os.cpu_count(),
             "network": desc, "link_check": link_check, "workloads": plan.workloads,
             "skipped_defaults": plan.skipped, "elapsed_s": time.time() - t_start,
             "interrupted": outcome.interrupted, "stops": outcome.stops,
             "fsdp_mesh": list(plan.fsdp_mesh) if plan.fsdp_mesh else None}
    rows = [report.summarize(rid, res, desc, commit) for rid, res in results.items()]
    report.apply_targets(rows, results)
    report.add_baseline_ratios(rows)
    summary = report.aggregate(rows)
    report.write_csvs(plan.out_dir, rows, results)
    report.write_summary_csv(os.path.join(plan.out_dir, "summary.csv"), summary)
    report.write_json(os.path.join(plan.out_dir, "results.json"), sweep, rows, results, summary)
    for w in plan.workloads:
        sel = report_plot.plot_rows(rows, results, w)
        if sel:
            title = f"{w} ({WORKLOADS[w][0]}), {args.workers} workers: time to accuracy"
            report_plot.plot(report_plot.plot_path(plan.out_dir, w), sel, results, title, desc)
        auto_rows = report_plot.choice_rows(rows, results, w)
        if auto_rows:
            report_plot.plot_choices(report_plot.choices_plot_path(plan.out_dir, w), auto_rows, results,
                                f"{w}: what auto sent each tensor with, step by step")
    table = report_table.format_table(rows, desc, results)
    md = report_table.markdown_table(rows, desc, results)
    elapsed = time.time() - t_start
    with open(os.path.join(plan.out_dir, "summary.md"), "w") as f:
        f.write(md + "\n")
    adam = report.format_adam_ratios(report.adam_ratios(rows, results))
    if adam:  # the LM workers' optimizer probe: ours / FP16 (geometric means over tensors)
        with open(os.path.join(plan.out_dir, "adam_ratios.md"), "w") as f:
            f.write(adam + "\n")
    print()
    print(table)
    print(f"\nSweep took {elapsed / 60:.1f} min; outputs in {plan.out_dir}")


def main(argv=None) -> int:
    """``python -m hvd_gradcomp.bench tta``: plan, run, report, then publish to ``--update-doc``.

    Returns the exit status: 0 every run ok, 1 some run failed, 2 bad options, 3 the link
    check failed (nothing written but the runs' folder), 130 interrupted.
    """
    args = build_parser().parse_args(argv)
    t_start = time.time()
    try:
        plan = plan_sweep(args)
    except ValueError as e:
        print(f"tta: {e}", file=sys.stderr)
        return 2
    outcome = run_sweep(plan, args)
    if outcome.link_failed:
        return 3
    report_sweep(plan, args, outcome, argv, t_start)
    # From the saved results.json, exactly as `publish` renders it later.
    publish.publish(os.path.join(plan.out_dir, "results.json"), args.update_doc, args.doc_block)
    if outcome.interrupted:
        return 130
    return 0 if all(r.get("status") == "ok" for r in outcome.results.values()) else 1
