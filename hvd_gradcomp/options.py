"""Checks for scheme options: one rule per kind of option, one wording for every error.

Every config's ``__post_init__`` (and the routing's ``min_numel``) checks its fields with these
functions, so the same kind of option is accepted and refused alike in every scheme, and every
refusal reads::

    ValueError: <scheme>: <option> must be <rule>, got <value!r>

e.g. ``"thc: bits must be an integer in [1, 16], got 17"``, ``"topkc: ratio must be a number
in (0, 1], got 1.5"``, ``"powersgd: error_feedback must be True or False, got 1"``,
``"topkc: selection must be 'previous' or 'current', got 'lagged'"``.

Kinds:
    integer: a Python ``int`` that is not a ``bool`` (``2.0``, ``True`` and NumPy integers are
        refused), optionally bounded by closed bounds ``[lo, hi]``.
    number: an ``int`` or ``float`` that is not a ``bool`` (strings are refused), bounded by
        ``lo``/``hi``, each closed or open; NaN fails every bound. Without an upper bound
        ``inf`` is accepted (e.g. PowerSGD's ``min_compression_rate=inf``: never compress).
    boolean: ``True`` or ``False`` only (not ``1``, ``"yes"``; spec strings are converted by
        :func:`hvd_gradcomp.registry.parse_spec` before they get here).
    choice: one of a tuple of values, compared with ``==``.

Options shared by several schemes have one rule, given here once:
    ``seed``: :func:`check_seed`, an integer >= 0 (THC, PowerSGD).
    ``error_feedback`` and other switches: :func:`check_bool`.
    ``ratio``: :func:`check_ratio`, a number in (0, 1] (TopK, TopKC).
    a float dtype on the wire: :func:`check_choice` with :data:`WIRE_DTYPES`
    (TopKC's ``payload_dtype``, PowerSGD's ``uncompressed_dtype``).
"""
__all__ = ["WIRE_DTYPES", "check_int", "check_float", "check_bool", "check_choice", "check_seed",
           "check_ratio"]

# Float dtypes an option may put on the wire: Horovod all-reduces both in every framework
# (it has no bfloat16, see cast.py).
WIRE_DTYPES = ("float16", "float32")


def _fail(scheme: str, name: str, rule: str, value):
    raise ValueError(f"{scheme}: {name} must be {rule}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> str:
    """A bound as written in a message: ``1`` for 1.0, else ``str`` (``0.5``)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _rule(kind: str, lo, hi, lo_open=False, hi_open=False) -> str:
    """The rule as a message states it: ``"an integer in [1, 16]"``, ``"a number > 0"``."""
    if lo is not None and hi is not None:
        return f"{kind} in {'(' if lo_open else '['}{_number(lo)}, {_number(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{kind} {'>' if lo_open else '>='} {_number(lo)}"
    if hi is not None:
        return f"{kind} {'<' if hi_open else '<='} {_number(hi)}"
    return kind


def check_int(scheme: str, name: str, value, lo=None, hi=None):
    """Check that an option is an integer within the closed bounds ``[lo, hi]``.

    Args:
        scheme: the scheme's name, first word of the message (``"thc"``).
        name: the option's name (``"bits"``).
        value: what the user gave.
        lo, hi: smallest and largest accepted value (ints); None for no bound.

    Raises:
        ValueError: ``value`` is not an ``int`` (a ``bool`` or ``2.0`` is refused) or lies
            outside the bounds, e.g. ``"thc: bits must be an integer in [1, 16], got 17"``,
            ``"topkc: chunk must be an integer >= 1, got 0"``.
    """
    if not _is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        _fail(scheme, name, _rule("an integer", lo, hi), value)


def check_float(scheme: str, name: str, value, lo=None, hi=None, lo_open=False, hi_open=False):
    """Check that an option is a number (``int`` or ``float``) within the bounds.

    Args:
        scheme: the scheme's name, first word of the message.
        name: the option's name.
        value: what the user gave.
        lo, hi: lower and upper bound; None for no bound.
        lo_open, hi_open: the bound itself is refused (``(lo, ...``), else accepted (``[lo, ...``).

    NaN fails any bound; with no bounds at all it is accepted (no option uses that).

    Raises:
        ValueError: ``value`` is a ``bool``, a string or another non-number, or lies outside
            the bounds, e.g. ``"thc: saturation_rate must be a number in (0, 0.5], got 0.7"``,
            ``"powersgd: min_compression_rate must be a number >= 1, got 0.5"``.
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        _fail(scheme, name, _rule("a number", lo, hi, lo_open, hi_open), value)


def check_bool(scheme: str, name: str, value):
    """Check that an option is ``True`` or ``False``.

    Raises:
        ValueError: anything else (``1``, ``"yes"``, None), e.g.
            ``"topkc: error_feedback must be True or False, got 'yes'"``.
    """
    if not isinstance(value, bool):
        _fail(scheme, name, "True or False", value)


def check_choice(scheme: str, name: str, value, choices):
    """Check that an option is one of ``choices`` (a tuple; compared with ``==``).

    Raises:
        ValueError: ``value`` is none of them, listing them in order, e.g.
            ``"thc: rotation must be 'partial' or 'full', got 'half'"``,
            ``"x: mode must be 'a', 'b' or 'c', got 'd'"``.
    """
    if value not in choices:
        names = [repr(c) for c in choices]
        rule = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        _fail(scheme, name, rule, value)


def check_seed(scheme: str, name: str, value):
    """Check a seed: an integer >= 0, the rule for every scheme's ``seed``.

    Seeds key :func:`hvd_gradcomp.rng.stream_key`, which takes any integer; the lower bound
    is the common convention (NumPy's) and the same in every scheme.

    Raises:
        ValueError: not an integer, or negative, e.g. ``"thc: seed must be an integer >= 0,
            got -1"``.
    """
    check_int(scheme, name, value, lo=0)


def check_ratio(scheme: str, name: str, value):
    """Check a fraction of things kept: a number in (0, 1] (TopK's and TopKC's ``ratio``).

    Raises:
        ValueError: not a number, or outside (0, 1], e.g. ``"topk: ratio must be a number
            in (0, 1], got -0.1"``.
    """
    check_float(scheme, name, value, lo=0.0, hi=1.0, lo_open=True)

