"""``python -m hvd_gradcomp``: list every compressor's options, from their declarations.

    python -m hvd_gradcomp --list [SCHEME ...]        plain text (the default)
    python -m hvd_gradcomp --markdown                  the option table of docs/options.md
    python -m hvd_gradcomp --update-doc [FILE]         rewrite that table in FILE (default
                                                       docs/options.md of the source checkout),
                                                       between <!-- options:start --> and <!-- options:end -->

Everything printed comes from the ``option(...)`` declarations of the scheme configs
(:mod:`hvd_gradcomp.options`, :func:`hvd_gradcomp.registry.describe_options`).
"""
import argparse
import os
import sys

from .registry import OPTIONS_BLOCK, describe_options

__all__ = ["OPTIONS_DOC", "build_parser", "main", "update_block"]

# The page that holds the generated option table, in a source checkout.
OPTIONS_DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "options.md")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m hvd_gradcomp``."""
    p = argparse.ArgumentParser(
        prog="python -m hvd_gradcomp",
        description="List the options of every compressor (kind, range, default, which way "
                    "compresses harder, what it does), as declared in the scheme configs. "
                    "A compressor spec sets them: 'topkc:ratio=0.1,chunk=128'.")
    p.add_argument("schemes", nargs="*", metavar="SCHEME",
                   help="schemes to list (default: all)")
    p.add_argument("--list", action="store_true", help="plain-text listing (the default)")
    p.add_argument("--markdown", action="store_true", help="a Markdown table, as in docs/options.md")
    p.add_argument("--update-doc", action="append", default=[], nargs="?", const=OPTIONS_DOC,
                   metavar="FILE",
                   help=f"replace the Markdown table between <!-- {OPTIONS_BLOCK}:start --> and "
                        f"<!-- {OPTIONS_BLOCK}:end --> in FILE (default {OPTIONS_DOC}; repeatable)")
    return p


def update_block(path: str, body: str, block: str = OPTIONS_BLOCK):
    """Replace the text between ``<!-- BLOCK:start -->`` and ``<!-- BLOCK:end -->`` in a file
    with ``body``.

    Raises:
        ValueError: the file lacks the markers (nothing is written).
    """
    start, end = f"<!-- {block}:start -->", f"<!-- {block}:end -->"
    with open(path) as f:
        text = f.read()
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"{path}: expected the markers {start} and {end}")
    with open(path, "w") as f:
        f.write(text[:i + len(start)] + "\n" + body.strip() + "\n" + text[j:])


def main(argv=None) -> int:
    """Run the command line; returns the exit status (2 for an unknown scheme or missing
    markers)."""
    args = build_parser().parse_args(argv)
    names = args.schemes or None
    try:
        if args.update_doc:
            table = describe_options(names, markdown=True)
            for path in args.update_doc:
                update_block(path, table)
                print(f"wrote the option table into {path}")
            return 0
        print(describe_options(names, markdown=args.markdown))
    except ValueError as err:
        print(f"python -m hvd_gradcomp: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
