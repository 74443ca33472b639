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
   replicas, :func:`.tta_hooks.parse_fsdp_hooks`); then one *no-communication reference* per workload
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
import os
import signal
import sys
import time
from typing import NamedTuple, Optional

from . import device, fp16_estimate, launch, linkcheck, netem, publish, report, report_plot, report_table
from .tta import (ADAM_ROWS, DEFAULT_BANDWIDTH_MBIT, DEFAULT_CANDIDATES, DEFAULT_DDP_HOOKS, FP16_TTA_CAP,
                  FSDP_WORKLOADS, SWEEP_DEFAULTS, WORKLOAD_SWEEP_DEFAULTS, WORKLOADS, check_rows,
                  default_specs, interleave, parse_compressors, plan_runs)
from .tta_hooks import parse_ddp_hooks, parse_fsdp_hooks, parse_fsdp_mesh
from .tta_run import execute, git_commit, is_fp16_baseline, note_fp16, stop_flags, stop_group, versions

__all__ = ["main", "build_parser", "plan_sweep", "run_sweep", "report_sweep", "SweepPlan",
           "SweepOutcome", "sweep_defaults"]


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
                        "with our hook, register_comm_hook(..., delay=D); a delay(D) with D >= 2 is "
                        "reported as not run: the hook takes delay=1 only). Default: every registered "
                        f"default, from {'; '.join(DEFAULT_CANDIDATES)}; for lm-comm alone: "
                        f"{'; '.join(ADAM_ROWS)}. 'off': no Horovod rows (with --ddp-hooks or "
                        "--fsdp-hooks rows). Every scheme's options: python -m hvd_gradcomp --list")
    p.add_argument("--ddp-hooks", default=None,
                   help="';'-separated DDP hooks for PyTorch workloads (none, fp16, powersgd:rank=R: "
                        "DDP's own; ours:SPEC: our compressor as a DDP hook); "
                        f"'off' for none (default {DEFAULT_DDP_HOOKS}; lm-comm alone: off)")
    p.add_argument("--fsdp-hooks", default="off",
                   help="';'-separated FSDP rows for the LM workloads (lm, lm-comm): HSDP on the "
                        "--fsdp-mesh, each row the spec of the all-reduce across replicas (fp16: "
                        "FP16-FSDP, FSDP's own float16 collectives, the rows' baseline, always run "
                        "first; none: FSDP's own float32; any other: ours, torch_backend.fsdp.install), "
                        "optionally 'with rs=SPEC' (the reduce-scatter within a replica compressed "
                        "too: none, fp16, bf16, thc, signsgd), 'with overlap' (install(..., "
                        "overlap=True)) or 'with delay(1)' (install(..., delay=1): step t's mean "
                        "applied at step t + 1), e.g. 'fp16;thc;topkc:ratio=0.1;thc with rs=thc;thc "
                        "with delay(1)'; 'off' for none")
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
    p.add_argument("--ddp-bucket-cap-mb", type=float, default=None,
                   help="DDP's bucket_cap_mb for the rows of our hooks on DDP (ours:SPEC, delay(D) "
                        "rows) and DDP fp32 (default: 64, the whole gradient in one bucket posted "
                        "after backward; smaller: buckets overlap the rest of backward); DDP's own "
                        "fp16 and PowerSGD hooks keep one bucket")
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

    workloads: workload keys, in order. runs: the :class:`.tta.RunSpec` list in the order they run
    (table order; with repeats, round after round, :func:`.tta.interleave`).
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
    after FP16 stopped at (:func:`.tta_run.note_fp16`).
    """

    results: dict
    network: dict
    link_check: Optional[dict]
    link_failed: bool
    interrupted: bool
    stops: dict = {}


def sweep_defaults(workloads):
    """The defaults of the options left unset (``--bandwidth``, ``--max-seconds``,
    ``--compressors``, ``--ddp-hooks``, ``--no-comm-reference``): :data:`.tta.SWEEP_DEFAULTS`,
    overridden by :data:`.tta.WORKLOAD_SWEEP_DEFAULTS` when every workload of the sweep has the
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
            mesh the workers do not divide into, ``--ddp-bucket-cap-mb`` not above 0, ``--ranks-per-host`` not dividing the workers,
            a sweep with no rows, or a link setting out of range (the message says which).
    """
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    cap = getattr(args, "ddp_bucket_cap_mb", None)
    if cap is not None and not cap > 0:
        raise ValueError(f"--ddp-bucket-cap-mb must be > 0, got {cap:g}")
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
                ref = refs.get(run.workload) if run.system == "horovod" and is_fp16_baseline(run) else None
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
    commit = git_commit()
    sweep = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": list(argv or sys.argv[1:]),
             "git_commit": commit, "versions": versions(), "cpu_count": os.cpu_count(),
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
