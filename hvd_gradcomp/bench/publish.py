"""``python -m hvd_gradcomp.bench publish``: a finished sweep's table and plots into a doc.

    python -m hvd_gradcomp.bench publish --results docs/tta-demo/results.json \
        --update-doc docs/tta.md --doc-block tta-demo

Reads only what the sweep saved in its ``--out`` folder: ``results.json`` (sweep metadata,
one summary row per run, every run's records) and the plots ``tta_<workload>.png`` beside
it, and replaces the text between ``<!-- BLOCK:start -->`` and ``<!-- BLOCK:end -->`` in each
``--update-doc`` file with the Markdown table, the plots (paths relative to the doc) and a
line naming the run (date, commit, runs, duration, workers, cores, command, link check).
Nothing is trained and no network is built, so changing the table's wording or columns
needs no new sweep. ``tta --update-doc`` writes its block through :func:`render_block` too.
Without ``--update-doc`` the block (paths relative to the current directory) is printed.
"""
import argparse
import json
import os
import sys

from . import report, report_plot, report_table

__all__ = ["render_block", "load_results", "publish", "main"]


def load_results(path):
    """A sweep's saved ``results.json`` (``path`` is the file or its run folder).

    The runs' targets relative to FP16, TTA and steps to target are recomputed from the saved
    evaluations (:func:`.report.apply_targets`), and their ratio columns (``tta_vs_fp16``,
    ``tta_vs_best_ddp``, ``fp16_bytes_ratio``, ``steps_vs_fp16``, ``step_time_vs_fp16``) with
    :func:`.report.add_baseline_ratios` (the same values for a sweep of this version; filled
    in for a sweep saved before a column existed).

    Returns:
        (data, out_dir): ``data`` with keys ``sweep``, ``runs`` and ``results``; ``out_dir``
        the absolute folder holding the file (where the sweep wrote its plots).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file lacks ``sweep``, ``runs`` or ``results``.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "results.json")
    with open(path) as f:
        data = json.load(f)
    missing = [k for k in ("sweep", "runs", "results") if k not in data]
    if missing:
        raise ValueError(f"publish: {path} lacks {missing}; expected a tta sweep's results.json")
    report.apply_targets(data["runs"], data["results"])
    report.add_baseline_ratios(data["runs"])
    return data, os.path.dirname(os.path.abspath(path))


def render_block(sweep, rows, results, out_dir, doc_path):
    """The Markdown block for one doc: table, plots, and the line naming the run.

    Args:
        sweep: the sweep metadata (``results.json``'s ``sweep``: date, argv, git_commit,
            cpu_count, network, link_check, workloads, elapsed_s).
        rows: the run summaries (``report.RUN_COLUMNS`` dicts), in table order.
        results: run id -> the run's result dict (for which plots exist).
        out_dir: the sweep's output folder (absolute), holding ``tta_<workload>.png``.
        doc_path: the document the block goes into; plot links are relative to its folder.

    Returns:
        the block text (no markers).
    """
    network = sweep["network"]
    plots = [report_plot.plot_path(out_dir, w) for w in sweep["workloads"]
             if report_plot.plot_rows(rows, results, w)]
    plots += [report_plot.choices_plot_path(out_dir, w) for w in sweep["workloads"]
              if report_plot.choice_rows(rows, results, w)]
    rel = [os.path.relpath(p, os.path.dirname(os.path.abspath(doc_path))) for p in plots]
    link_check = sweep.get("link_check")
    lc = ""
    if link_check and link_check.get("model_seconds"):
        lc = (f" Link check: a {link_check['nbytes'] / 2**20:.0f} MiB all-reduce took "
              f"{link_check['seconds']:.3f} s against {link_check['model_seconds']:.3f} s for the ring "
              f"model (ratio {link_check['ratio']:.2f}).")
    elapsed = sweep["elapsed_s"]
    return (report_table.markdown_table(rows, network, results) + "\n\n"
            + "\n".join(f"![{os.path.basename(p)}]({p})" for p in rel)
            + f"\n\nRun of {sweep['date']} at commit `{sweep['git_commit']}`: {len(rows)} runs in "
              f"{elapsed / 60:.1f} min, {network['world_size']} workers, {sweep['cpu_count']} cores; "
              f"command `python -m hvd_gradcomp.bench tta {' '.join(sweep['argv'])}`.{lc}")


def publish(results_path, docs, block="tta-demo"):
    """Rewrite the ``block`` of every file in ``docs`` from a saved sweep (module docs).

    Returns:
        the list of docs written.

    Raises:
        FileNotFoundError / ValueError: as :func:`load_results`; ValueError also when a doc
            lacks the block's markers (that doc and those after it are not written).
    """
    data, out_dir = load_results(results_path)
    for doc in docs:
        text = render_block(data["sweep"], data["runs"], data["results"], out_dir, doc)
        report.update_doc(doc, text, block)
    return list(docs)


def build_parser():
    """The command line of ``python -m hvd_gradcomp.bench publish``."""
    p = argparse.ArgumentParser(prog="python -m hvd_gradcomp.bench publish",
                                description="Write a finished TTA sweep's table and plots into a "
                                            "Markdown block, from its saved results.json.")
    p.add_argument("--results", required=True,
                   help="the sweep's results.json, or its output folder")
    p.add_argument("--update-doc", action="append", default=[],
                   help="a Markdown file whose <!-- BLOCK:start/end --> block gets the table and "
                        "plots (repeatable); none: print the block")
    p.add_argument("--doc-block", default="tta-demo", help="BLOCK name")
    return p


def main(argv=None) -> int:
    """Exit status: 0 written (or printed), 2 no readable results or a doc without the markers."""
    args = build_parser().parse_args(argv)
    try:
        if not args.update_doc:
            data, out_dir = load_results(args.results)
            print(render_block(data["sweep"], data["runs"], data["results"], out_dir,
                               os.path.join(os.getcwd(), "stdout.md")))
            return 0
        for doc in publish(args.results, args.update_doc, args.doc_block):
            print(f"publish: wrote the {args.doc_block} block of {doc}", file=sys.stderr)
    except (OSError, ValueError, KeyError) as e:
        print(f"publish: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
