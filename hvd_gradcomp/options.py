"""Scheme options: declared once per field, checked one way, one wording for every error.

Each scheme's config is a frozen dataclass whose fields are declared with :func:`option`: the
option's kind, its range or choices, its default, which way compresses harder and a one-line
doc, all in one place::

    @dataclass(frozen=True)
    class THCConfig:
        SCHEME: ClassVar[str] = "thc"
        bits: int = option(4, kind="integer", lo=1, hi=16, harder="down",
                           doc="bits per level: 2^bits - 1 levels above 0")

        def __post_init__(self):
            validate(self)

Everything else is derived from that declaration (:class:`Option`): validation
(:func:`validate`), spec-string parsing (:meth:`Option.parse`, used by
:func:`hvd_gradcomp.registry.parse_spec`), canonical spec strings (:meth:`Option.format`, used
by :func:`hvd_gradcomp.registry.to_spec`), the listing ``python -m hvd_gradcomp --list`` and
docs/options.md's option table (:func:`hvd_gradcomp.registry.describe_options`).

Every refusal reads::

    ValueError: <scheme>: <option> must be <rule>, got <value!r>

with the value's type added when it is not a Python one (``got tensor(0.1000) (torch.Tensor)``),

e.g. ``"thc: bits must be an integer in [1, 16], got 17"``, ``"topkc: ratio must be a number
in (0, 1], got 1.5"``, ``"powersgd: error_feedback must be True or False, got 1"``,
``"topkc: selection must be 'previous' or 'current', got 'lagged'"``; a spec string's value
that does not parse reads the same with the text as given (``"thc: bits must be an integer in
[1, 16], got 'four'"``).

Kinds:
    integer: an integer that is not a ``bool``: a Python ``int`` or another
        :class:`numbers.Integral` such as a NumPy integer, kept as a Python ``int`` (``2.0``,
        ``True``, strings and tensors are refused), optionally bounded by closed bounds
        ``[lo, hi]``.
    number: a :class:`numbers.Real` that is not a ``bool``: ``int``, ``float``, NumPy scalars
        (strings, tensors and ``numpy.bool_`` are refused), kept as a Python ``float``
        (:func:`plain_number`: ``np.float32(0.1)`` is kept as ``0.1``), bounded by
        ``lo``/``hi``, each closed or open; NaN fails every bound. Without an upper bound
        ``inf`` is accepted (e.g. PowerSGD's ``min_compression_rate=inf``: never compress).
        A config keeps it as a ``float`` (``ratio=1`` is stored as ``1.0``), so equal configs
        print the same spec.
    boolean: ``True`` or ``False`` only (not ``1``, ``"yes"``); in a spec string ``true``/
        ``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``), canonically ``true``/``false``.
        A boolean may name extra ``choices``: strings accepted besides the two truth values
        (``error_feedback``'s ``"ef21"``, a third variant of a switch), canonically as named.
    choice: one of a tuple of strings, compared with ``==``.
    text: a non-empty string without commas (a spec string's option separator), e.g.
        ``auto``'s ``candidates`` (``"fp16|topkc:0.1|thc:4"``); the scheme checks its content.

Any kind may be declared ``optional=True``: None is then accepted too (``none`` in a spec
string, canonically ``none``), e.g. a value measured when not given.

Which way compresses harder (``harder``): ``"down"`` (a lower value sends fewer bytes),
``"up"`` (a higher value does), one of the choices (that choice does), or None (the option
does not move the bytes one way: it trades them against something else, or leaves them
alone). Stated for tensors large enough that fixed costs do not matter; a test checks it
against each scheme's ``wire()``.

Options shared by several schemes have one declaration, given here once: ``seed``
(:func:`seed_option`, an integer >= 0), ``error_feedback`` (:func:`error_feedback_option`),
``ratio`` (:func:`ratio_option`, a number in (0, 1]) and a float dtype on the wire
(:func:`wire_dtype_option`, one of :data:`WIRE_DTYPES`). The ``check_*`` functions are the
rules themselves, usable alone.
"""
import dataclasses
import math
import numbers
from typing import NamedTuple, Optional

__all__ = ["WARMUP", "WARMUP_OPTION", "MIN_NUMEL", "ROUTING_OPTION", "to_spec", "WIRE_DTYPES", "KINDS", "Option", "option", "option_of",
           "options_of", "validate", "seed_option", "ratio_option", "error_feedback_option",
           "wire_dtype_option", "plain_number", "check_int", "check_float", "check_bool", "check_choice"]

# Float dtypes an option may put on the wire: Horovod all-reduces both in every framework
# (it has no bfloat16, see cast.py).
WIRE_DTYPES = ("float16", "float32")
# The kinds an option may be (module docstring).
KINDS = ("integer", "number", "boolean", "choice", "text")
# Spec-string words for booleans.
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
# The field-metadata key an option's declaration is kept under.
_KEY = "hvd_gradcomp.option"


# Types whose repr says what they are; any other value's type is named in a refusal.
_PLAIN_TYPES = (int, float, bool, str, type(None))


def _fail(scheme: str, name: str, rule: str, value):
    kind = type(value)
    typed = "" if kind in _PLAIN_TYPES else f" ({kind.__module__}.{kind.__qualname__})"
    raise ValueError(f"{scheme}: {name} must be {rule}, got {value!r}{typed}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def plain_number(value):
    """The Python ``int`` or ``float`` a number given as an option stands for.

    An :class:`numbers.Integral` (NumPy integers) -> ``int``. Another real (``np.float32``,
    ``np.float64``, ``Fraction``) -> the shortest decimal that is the same value in the
    value's own type, as a ``float``: ``np.float32(0.1)`` -> ``0.1`` (not
    ``0.10000000149011612``, its exact value, which would move a ``ratio`` of 1000
    coordinates from 100 to 101 kept); when the type cannot say (``Fraction(1, 3)``), its
    exact ``float``. Python ``int``/``float`` as they are.
    """
    if type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    exact = float(value)
    try:
        short = float(str(value))
        if type(value)(short) == value:
            return short
    except (ValueError, TypeError, OverflowError):
        pass
    return exact


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


def _choice_rule(choices) -> str:
    """Choices as a message lists them: ``"'a', 'b' or 'c'"``."""
    names = [repr(c) for c in choices]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_int(scheme: str, name: str, value, lo=None, hi=None):
    """Check that an option is an integer within the closed bounds ``[lo, hi]``.

    Args:
        scheme: the scheme's name, first word of the message (``"thc"``).
        name: the option's name (``"bits"``).
        value: what the user gave.
        lo, hi: smallest and largest accepted value (ints); None for no bound.

    Raises:
        ValueError: ``value`` is not an integer (:class:`numbers.Integral`: a ``bool`` or
            ``2.0`` is refused) or lies outside the bounds, e.g. ``"thc: bits must be an integer in [1, 16], got 17"``,
            ``"topkc: chunk must be an integer >= 1, got 0"``.
    """
    if not _is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        _fail(scheme, name, _rule("an integer", lo, hi), value)


def check_float(scheme: str, name: str, value, lo=None, hi=None, lo_open=False, hi_open=False):
    """Check that an option is a number (:class:`numbers.Real`: ``int``, ``float``, NumPy
    scalars) within the bounds.

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
    ok = _is_number(value)
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
        _fail(scheme, name, _choice_rule(choices), value)


class Option(NamedTuple):
    """One option's declaration: everything the library says about it comes from here.

    Attributes:
        kind: one of :data:`KINDS`.
        default: the value when none is given (also the dataclass field's default).
        doc: one line saying what the option does, for listings and docs/options.md's table.
        lo, hi: bounds of an integer (closed) or number (see ``lo_open``/``hi_open``); None
            for no bound.
        lo_open, hi_open: a number's bound itself is refused.
        choices: the values a choice may take, in the order messages list them.
        harder: which way compresses harder: ``"down"``, ``"up"``, one of ``choices``, or None
            (module docstring).
        optional: None is accepted too (``none`` in a spec string).
    """

    kind: str
    default: object
    doc: str
    lo: object = None
    hi: object = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple = ()
    harder: Optional[str] = None
    optional: bool = False

    def rule(self) -> str:
        """The rule as an error message states it: ``"an integer in [1, 16]"``, ``"True or
        False"``, ``"'previous' or 'current'"`` (``" or None"`` added when optional)."""
        if self.kind == "integer":
            rule = _rule("an integer", self.lo, self.hi)
        elif self.kind == "number":
            rule = _rule("a number", self.lo, self.hi, self.lo_open, self.hi_open)
        elif self.kind == "boolean":
            names = ["True", "False"] + [repr(c) for c in self.choices]
            rule = ", ".join(names[:-1]) + " or " + names[-1]
        elif self.kind == "text":
            rule = "a non-empty string without commas"
        else:
            rule = _choice_rule(self.choices)
        return rule + (" or None" if self.optional else "")

    def values(self) -> str:
        """What a spec string may give, for listings: ``"integer in [1, 16]"``, ``"true or
        false"``, ``"previous or current"`` (``", or none"`` added when optional)."""
        if self.kind == "integer":
            text = _rule("integer", self.lo, self.hi)
        elif self.kind == "number":
            text = _rule("number", self.lo, self.hi, self.lo_open, self.hi_open)
        elif self.kind == "boolean":
            names = ("true", "false") + self.choices
            text = ", ".join(names[:-1]) + " or " + names[-1]
        elif self.kind == "text":
            text = "text without commas"
        else:
            text = " or ".join(self.choices) if len(self.choices) < 3 else (
                ", ".join(self.choices[:-1]) + " or " + self.choices[-1])
        return text + (", or none" if self.optional else "")

    def harder_text(self) -> str:
        """Which way compresses harder, in words: ``"lower"``, ``"higher"``, a choice, or
        ``"-"`` (none)."""
        return {"down": "lower", "up": "higher", None: "-"}.get(self.harder, self.harder)

    def check(self, scheme: str, name: str, value):
        """Check a value given for this option.

        Args:
            scheme: the scheme's name, first word of the message (``"thc"``).
            name: the option's name (``"bits"``).
            value: what the user gave (a Python value, not spec text).

        Raises:
            ValueError: ``"<scheme>: <name> must be <rule>, got <value!r>"``.
        """
        if self.optional:
            if value is not None:
                try:
                    self._replace(optional=False).check(scheme, name, value)
                except ValueError:
                    _fail(scheme, name, self.rule(), value)
            return
        if self.kind == "integer":
            check_int(scheme, name, value, self.lo, self.hi)
        elif self.kind == "number":
            check_float(scheme, name, value, self.lo, self.hi, self.lo_open, self.hi_open)
        elif self.kind == "boolean":
            if self.choices and isinstance(value, str) and value in self.choices:
                return
            if self.choices and not isinstance(value, bool):
                _fail(scheme, name, self.rule(), value)
            check_bool(scheme, name, value)
        elif self.kind == "text":
            if not isinstance(value, str) or not value.strip() or "," in value:
                _fail(scheme, name, self.rule(), value)
        else:
            check_choice(scheme, name, value, self.choices)

    def normalise(self, value):
        """The value a config keeps: a number becomes a Python ``float`` (``1`` -> ``1.0``,
        ``np.float32(0.1)`` -> ``0.1``: :func:`plain_number`), an integer a Python ``int``
        (``np.int64(4)`` -> ``4``); anything else as it is. Call after :meth:`check`."""
        if self.kind == "number" and _is_number(value):
            return float(plain_number(value))
        if self.kind == "integer" and _is_int(value):
            return int(value)
        return value

    def parse(self, scheme: str, name: str, text: str):
        """The value a spec string's ``text`` gives (``"0.1"`` -> ``0.1``, ``"false"`` ->
        ``False``, case-insensitive words), unchecked against the range (:meth:`check` does).

        Raises:
            ValueError: the text is not of the option's kind, e.g. ``"topkc: ratio must be a
                number in (0, 1], got 'abc'"``, ``"topkc: error_feedback must be true or
                false, got 'maybe'"``.
        """
        word = text.strip()
        if self.optional:
            if word.lower() in ("none", ""):
                return None
            try:
                return self._replace(optional=False).parse(scheme, name, word)
            except ValueError:
                _fail(scheme, name, self.rule(), word)
        if self.kind == "boolean":
            if word.lower() in _TRUE:
                return True
            if word.lower() in _FALSE:
                return False
            if word.lower() in self.choices:
                return word.lower()
            _fail(scheme, name, self.values(), word)
        if self.kind == "integer":
            try:
                return int(word)
            except ValueError:
                _fail(scheme, name, self.rule(), word)
        if self.kind == "number":
            try:
                value = float(word)
            except ValueError:
                _fail(scheme, name, self.rule(), word)
            return value
        return word

    def format(self, value) -> str:
        """The canonical spec text of a value: ``true``/``false``, ``0.1``, ``inf``, ``256``,
        ``float16``, ``none``; :meth:`parse` of it gives the value back."""
        if value is None:
            return "none"
        if self.kind == "boolean" and isinstance(value, bool):
            return "true" if value else "false"
        if self.kind == "number":
            return repr(float(value)) if math.isfinite(value) else str(float(value))
        return str(value)


def option(default, *, kind: str, doc: str, lo=None, hi=None, lo_open: bool = False,
           hi_open: bool = False, choices=(), harder=None, optional: bool = False):
    """Declare a config field: ``bits: int = option(4, kind="integer", lo=1, hi=16, ...)``.

    Returns a :func:`dataclasses.field` with ``default`` and the :class:`Option` in its
    metadata, where :func:`validate`, the spec parser and the listings find it.

    Raises:
        TypeError: a declaration that contradicts itself (unknown kind or ``harder``, bounds on
            a boolean or choice, no choices for a choice, a default that breaks its own rule),
            so a mistake shows when the module is imported.
    """
    decl = Option(kind, default, doc, lo, hi, lo_open, hi_open, tuple(choices), harder, optional)
    if kind not in KINDS:
        raise TypeError(f"option: kind must be one of {KINDS}, got {kind!r}")
    if (kind == "choice" and not decl.choices) or (kind not in ("choice", "boolean") and decl.choices):
        raise TypeError(f"option: choices are for kinds 'choice' (which needs them) and 'boolean' "
                        f"(extra words) only; got kind {kind!r} with choices {decl.choices!r}")
    if kind in ("boolean", "choice", "text") and (lo is not None or hi is not None):
        raise TypeError(f"option: a {kind} has no bounds")
    allowed = ("down", "up") if kind in ("integer", "number") else decl.choices if kind == "choice" else ()
    if harder is not None and harder not in allowed:
        raise TypeError(f"option: harder must be None or one of {allowed}, got {harder!r}")
    if not doc or "\n" in doc:
        raise TypeError("option: doc must be one line")
    try:
        decl.check("option", "default", default)
    except ValueError as err:
        raise TypeError(str(err)) from None
    return dataclasses.field(default=default, metadata={_KEY: decl})


def option_of(field: dataclasses.Field) -> Optional[Option]:
    """The :class:`Option` declared for a dataclass field, or None if it has none."""
    return field.metadata.get(_KEY)


def options_of(config) -> dict:
    """``{name: Option}`` of a config class or instance, in field order.

    Raises:
        TypeError: a field without an :func:`option` declaration (every option of a scheme
            must be declared, so it is checked, parsed and listed like the others).
    """
    out = {}
    for f in dataclasses.fields(config):
        decl = option_of(f)
        if decl is None:
            cls = config if isinstance(config, type) else type(config)
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with "
                            f"hvd_gradcomp.options.option(...)")
        out[f.name] = decl
    return out


def validate(config):
    """Check every declared option of a config (call it from ``__post_init__``).

    The scheme's name in messages is the config's ``SCHEME`` class attribute. Numbers given
    as ``int`` are stored as ``float`` (:meth:`Option.normalise`), also in frozen dataclasses.

    Raises:
        ValueError: the first option, in field order, that breaks its rule:
            ``"<scheme>: <option> must be <rule>, got <value!r>"``.
    """
    scheme = type(config).SCHEME
    for name, decl in options_of(config).items():
        value = getattr(config, name)
        decl.check(scheme, name, value)
        normal = decl.normalise(value)
        if normal is not value:
            object.__setattr__(config, name, normal)


def seed_option(doc: str):
    """The ``seed`` of every scheme that has one: an integer >= 0, default 0;
    ``doc`` says what it seeds."""
    return option(0, kind="integer", lo=0, doc=doc)


def ratio_option(default: float, doc: str):
    """A fraction of things kept (TopK's and TopKC's ``ratio``): a number in (0, 1];
    lower compresses harder."""
    return option(default, kind="number", lo=0.0, hi=1.0, lo_open=True, harder="down", doc=doc)


def error_feedback_option(doc: str = "keep what is not sent and add it to the next step's gradient",
                          variants=()):
    """The ``error_feedback`` switch of every scheme that has one: True or False, default True;
    ``variants`` are the other forms the scheme offers, by name (TopKC's and PowerSGD's
    ``"ef21"``: :mod:`hvd_gradcomp.topkc`), accepted besides True and False."""
    return option(True, kind="boolean", choices=variants, doc=doc)


def wire_dtype_option(doc: str, default: str = "float16"):
    """A float dtype on the wire, one of :data:`WIRE_DTYPES`; float16 compresses harder."""
    return option(default, kind="choice", choices=WIRE_DTYPES, harder="float16", doc=doc)


# The routing-level warm-up every compressor accepts (hvd_gradcomp.warmup).
WARMUP_OPTION = "fp16_warmup"
WARMUP = Option("integer", 0, "first steps of each tensor sent as fp16 before the scheme's own "
                "payload (hvd_gradcomp.warmup)", lo=0)
# The routing's one option, every compressor accepts (hvd_gradcomp.routing): tensors no rule
# names with fewer coordinates go to the fallback scheme. Its default is the default scheme's
# class attribute ``min_numel`` (:class:`~hvd_gradcomp.base.Scheme`), so this declaration's
# default (1: no size routing) is the base class's.
ROUTING_OPTION = "min_numel"
MIN_NUMEL = Option("integer", 1, "tensors no rule names with fewer coordinates go as fp16",
                   lo=1)


def to_spec(scheme, full: bool = False, skip=()) -> str:
    """The canonical spec of a scheme: options that differ from their defaults (every option
    with ``full=True``) in declaration order, each value as its option formats it
    (:meth:`~hvd_gradcomp.options.Option.format`: ``true``/``false``, ``0.1``), so equal
    configs give one string and :func:`parse_spec` of it gives the config back; options named
    in ``skip`` are left out. A warm-up (:data:`WARMUP`) comes last: ``topkc:ratio=0.1,fp16_warmup=50``."""
    steps = getattr(scheme, "steps", None) if hasattr(scheme, "inner") else None
    if steps is not None:
        text = to_spec(scheme.inner, full, skip)
        return text + ("," if ":" in text else ":") + f"{WARMUP_OPTION}={steps}"
    cfg = scheme.config
    parts = [f"{name}={decl.format(getattr(cfg, name))}"
             for name, decl in options_of(cfg).items()
             if name not in skip and (full or getattr(cfg, name) != decl.default)]
    return scheme.name + (":" + ",".join(parts) if parts else "")
