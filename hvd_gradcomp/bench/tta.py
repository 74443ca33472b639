"""What a time-to-accuracy sweep runs (``python -m hvd_gradcomp.bench tta``: the command is
:mod:`.tta_sweep`): the workloads and their defaults, the rows (``SPEC[ with CLAUSE]...``,
:func:`parse_row`, the delay clause's :func:`delay_support` included) and the planned runs
(:class:`RunSpec`, :func:`plan_runs`, :func:`interleave`). The DDP and FSDP rows' options are
parsed in :mod:`.tta_hooks`; a run is started and stopped by :mod:`.tta_run`.
"""
import re
import sys

from typing import NamedTuple, Optional

from .tta_hooks import fsdp_label

__all__ = ["default_specs", "parse_compressors", "check_rows", "plan_runs", "interleave", "RunSpec",
           "WORKLOADS", "NOCOMM_SPEC", "NOCOMM_LABEL", "Row", "parse_row", "parse_update_sync",
           "ADAM_ROWS", "FP16_TTA_CAP", "delay_support"]

# workload key -> (framework, worker module, workload name inside the worker, DDP-capable)
WORKLOADS = {
    "digits": ("torch", "hvd_gradcomp.bench.workers.digits_torch", "digits", True),
    "lm": ("torch", "hvd_gradcomp.bench.workers.lm_torch", "lm", True),
    "lm-comm": ("torch", "hvd_gradcomp.bench.workers.lm_comm_torch", "lm-comm", True),
    "lm-shakespeare": ("torch", "hvd_gradcomp.bench.workers.lm_shakespeare_torch", "lm-shakespeare", True),
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
FP16_TTA_CAP = {"lm-comm": 1.5, "lm-shakespeare": 1.5}
# Workloads whose worker takes ``--recipe`` (the sweep's ``--recipe`` is passed on).
RECIPE_WORKLOADS = ("lm-comm", "lm-shakespeare")
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
    :data:`NOCOMM_SPEC`) on an unthrottled loopback link (:func:`.tta_run.network_for`), label
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

    FSDP rows (``system="fsdp"``, :func:`.tta_hooks.parse_fsdp_hooks`): ``spec`` compresses the all-reduce
    across replicas (``fp16``: FP16-FSDP, FSDP's own float16 collectives; ``none``: its float32
    ones), ``reduce_scatter`` the reduce-scatter within the shard group (None: FSDP's own),
    ``overlap`` installs the hook with ``overlap=True``, ``delay`` with ``delay=1``; label
    :func:`.tta_hooks.fsdp_label`, row id ``<workload>-fsdp-<spec>[-with-delay-1][-with-rs-<spec>][-with-overlap]``.

    ``delay``: D >= 1 on a DDP row of ours (spec ``ours:<spec>``, from a ``SPEC with delay(D)``
    row): the hook registered with ``delay=D`` (delayed gradient sync; ``--delay D``), label
    ``SPEC with delay(D) on DDP``; on an FSDP row, ``install(..., delay=1)``.
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
            self.label = fsdp_label(spec, self.reduce_scatter, self.overlap, self.delay)
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


def delay_support(delay=1):
    """None when ``delay`` is one the DDP hook takes (``register_comm_hook(..., delay=1)``,
    :mod:`torch_backend.ddp_delayed`), else why not: a ``delay(D)`` row is then planned as not
    run, with that reason."""
    if delay > 1:
        return (f"torch_backend.ddp's delayed hook takes delay=1 only (step t's mean applied at step "
                f"t + 1), not delay={delay}")
    return None


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


def _eager_only(spec: str) -> bool:
    """True if ``spec`` routes some tensor to an adaptive scheme (``auto``: eager only)."""
    from hvd_gradcomp.routing import Routing
    return any(scheme.adaptive for scheme in Routing.from_spec(spec).schemes())


def plan_runs(workloads, specs, ddp_hooks, reference=False, unavailable=None, fsdp_rows=()):
    """The runs in table order: per workload, the Horovod specs, the DDP hooks (PyTorch
    workloads), the FSDP rows (``fsdp_rows``: :func:`.tta_hooks.parse_fsdp_hooks`'s pairs, FP16-FSDP
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
                                    unavailable=why or delay_support(parsed.delay), delay=parsed.delay))
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
            plan.extend(RunSpec(w, "fsdp", spec, reduce_scatter=rs, overlap=ov, delay=d)
                        for spec, rs, ov, d in fsdp_rows)
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
