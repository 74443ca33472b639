"""The text of a routing: compressor specs such as ``"*.bias -> fp16; thc:min_numel=4096"``.

A *compressor spec* (``Compression.from_spec``) is a scheme spec (:mod:`hvd_gradcomp.registry`)
with routing (:mod:`hvd_gradcomp.routing`): which scheme sends which tensor. Grammar::

    compressor := [rule ";"]... default [";" rule]...     (exactly one default)
    rule       := selector "->" scheme-spec
    selector   := term [whitespace term]...
    term       := glob                                     (at most one; fnmatch, case-sensitive)
                | "numel" (">=" | ">" | "<" | "<=") size     (coordinates of the tensor)
    size       := a whole number >= 0: digits, with "_" between them (1_000_000), or in
                  exponent form (1e6, 1E6, 2.5e5); written back as digits (numel>=1000000)
    default    := scheme-spec, which may also hold min_numel=N

Example: ``"*.bias -> fp16; *embed* -> topkc:0.01; numel>=1000000 -> powersgd:4;
thc:min_numel=4096"``. Rules are tried in order, the first whose every term matches wins;
a tensor no rule matches goes as fp16 if it has fewer than ``min_numel`` coordinates, else
with the default scheme. ``min_numel`` is a routing option every default accepts (``topk:0.1,
min_numel=1024``); its default is the default scheme's class attribute ``min_numel`` (1024
for ``thc``, ``topkc`` and ``auto``, 1, i.e. none, for the others). A rule's scheme-spec
takes no ``min_numel`` (use ``numel>=N``), and no scheme config has it:
:func:`~hvd_gradcomp.registry.parse_spec` and :func:`~hvd_gradcomp.registry.make_scheme`
refuse it as an unknown option; :func:`parse_routing` takes it off the default
(:func:`split_min_numel`). Whitespace around items is ignored; a spec without ``->`` is a
plain scheme spec.
"""
import fnmatch
import re
from decimal import Decimal, InvalidOperation
from typing import NamedTuple, Optional

from .options import MIN_NUMEL, ROUTING_OPTION
from .registry import given_twice, parse_spec

__all__ = ["RULE_ARROW", "Selector", "parse_size", "parse_selector", "format_selector", "split_min_numel", "with_min_numel",
           "RoutingSpec", "parse_routing"]

RULE_ARROW = "->"
# A size term takes everything up to the next whitespace as its number (parse_size checks it),
# so "numel>=1e6" is one term, never "numel>=1" and a glob "e6".
_SIZE_TERM = re.compile(r"numel\s*(>=|<=|>|<)\s*(\S*)")
_TERMS = re.compile(r"numel\s*(?:>=|<=|>|<)\s*\S*|\S+")
_SIZE_DIGITS = 18  # a bound has at most 19 digits (1e19 coordinates is no tensor's size)
_SIZE_TEXT = re.compile(r"[0-9](?:_?[0-9])*(?:\.[0-9]+)?(?:[eE][+]?[0-9]+)?")


def parse_size(text: str, where: str) -> int:
    """The number of a size term: ``"4096"``, ``"1_000_000"``, ``"1e6"``, ``"1E6"``,
    ``"2.5e5"`` -> an ``int`` (exact: decimal arithmetic, no float rounding).

    Args:
        text: the term's number as written.
        where: the selector, for the message.

    Raises:
        ValueError: not a whole number in [0, 1e19) in one of those forms (``"1.5"``,
            ``"-1"``, ``"1e-3"``, ``"1e30"``, ``"abc"``, empty), naming the selector.
    """
    value = None
    if _SIZE_TEXT.fullmatch(text):
        try:
            value = Decimal(text.replace("_", ""))
        except InvalidOperation:
            value = None
    if value is None or value.adjusted() > _SIZE_DIGITS or value != value.to_integral_value():
        raise ValueError(f"routing: selector {where!r}: numel bound must be a whole number in "
                         f"[0, 1e{_SIZE_DIGITS + 1}) (4096, 1_000_000 or 1e6), got {text!r}")
    return int(value)


class Selector(NamedTuple):
    """Which tensors a rule names: a glob on the name and a range of sizes.

    pattern: fnmatch glob (case-sensitive), "*" names every tensor (no name needed).
    min_numel: the tensor has at least this many coordinates (>= 0).
    max_numel: the tensor has fewer than this many coordinates (None: no bound).
    """

    pattern: str = "*"
    min_numel: int = 0
    max_numel: Optional[int] = None

    def matches(self, name, numel: int) -> bool:
        """True if a tensor called ``name`` with ``numel`` coordinates is selected."""
        if numel < self.min_numel or (self.max_numel is not None and numel >= self.max_numel):
            return False
        return self.pattern == "*" or fnmatch.fnmatchcase(name, self.pattern)


def parse_selector(text: str) -> Selector:
    """``"*embed* numel>=4096"`` -> ``Selector("*embed*", 4096, None)``.

    Raises:
        ValueError: two globs, an empty selector, a bound that is not a whole number
            (:func:`parse_size`), or bounds that select nothing.
    """
    pattern, low, high = None, 0, None
    terms = _TERMS.findall(text)
    if not terms:
        raise ValueError(f"routing: empty selector in {text!r}; expected a glob and/or numel bounds")
    for term in terms:
        size = _SIZE_TERM.fullmatch(term)
        if size is None:
            if pattern is not None:
                raise ValueError(f"routing: selector {text!r} has two globs ({pattern!r}, {term!r}); "
                                 f"expected at most one")
            pattern = term
            continue
        op, value = size.group(1), parse_size(size.group(2), text)
        if op in (">=", ">"):
            low = max(low, value + (op == ">"))
        else:
            bound = value + (op == "<=")
            high = bound if high is None else min(high, bound)
    if high is not None and high <= low:
        raise ValueError(f"routing: selector {text!r} selects no size (numel >= {low} and < {high})")
    return Selector(pattern or "*", low, high)


def format_selector(selector: Selector) -> str:
    """The canonical text of a selector (inverse of :func:`parse_selector`)."""
    terms = [selector.pattern] if selector.pattern != "*" or (
        not selector.min_numel and selector.max_numel is None) else []
    if selector.min_numel:
        terms.append(f"numel>={selector.min_numel}")
    if selector.max_numel is not None:
        terms.append(f"numel<{selector.max_numel}")
    return " ".join(terms)


def split_min_numel(spec: str):
    """``"topk:0.1,min_numel=512"`` -> ``("topk:0.1", 512)``; ``(spec, None)`` without it.

    Raises:
        ValueError: min_numel is not an integer >= 1, or given twice.
    """
    name, colon, rest = spec.strip().partition(":")
    kept, value = [], None
    for item in rest.split(","):
        key, eq, text = item.partition("=")
        if eq and key.strip().lower() == ROUTING_OPTION:
            if value is not None:
                raise given_twice(name.strip(), ROUTING_OPTION)
            value = MIN_NUMEL.parse(name.strip(), ROUTING_OPTION, text)
            MIN_NUMEL.check(name.strip(), ROUTING_OPTION, value)
        elif item.strip():
            kept.append(item.strip())
    return name.strip() + (":" + ",".join(kept) if kept else ""), value


def with_min_numel(spec: str, min_numel: int) -> str:
    """``spec`` with ``min_numel=N`` appended as its last option."""
    return spec + ("," if ":" in spec else ":") + f"min_numel={min_numel}"


class RoutingSpec(NamedTuple):
    """A parsed compressor spec: ``rules`` ((Selector, scheme spec text), ...) in order,
    ``default`` (scheme spec text, without min_numel) and ``min_numel`` (None: the default's)."""

    rules: tuple
    default: str
    min_numel: Optional[int]


def parse_routing(spec: str) -> RoutingSpec:
    """Split a compressor spec (module docstring) into rules, default and min_numel.

    The scheme specs are checked (names, options, values) by :func:`parse_spec`.

    Raises:
        ValueError: no default or two of them, a malformed selector or scheme spec, or
            ``min_numel`` inside a rule, each naming the item.
    """
    if not isinstance(spec, str):
        raise ValueError(f"expected a compressor spec string, got {type(spec).__name__}")
    rules, default, min_numel = [], None, None
    items = [item.strip() for item in spec.split(";") if item.strip()]
    if not items:
        raise ValueError(f"empty compressor spec {spec!r}")
    for item in items:
        selector, arrow, scheme = item.partition(RULE_ARROW)
        if not arrow:
            if default is not None:
                raise ValueError(f"routing: two defaults in {spec!r} ({default!r}, {item!r}); every "
                                 f"other item needs a selector: 'glob -> scheme'")
            default, min_numel = split_min_numel(item)
            parse_spec(default)
            continue
        scheme = scheme.strip()
        text, inner = split_min_numel(scheme)
        if inner is not None:
            raise ValueError(f"routing: rule {item!r}: min_numel is the default's threshold; in a "
                             f"rule use a size term, e.g. '{selector.strip()} numel>={inner} -> {text}'")
        parse_spec(text)
        rules.append((parse_selector(selector.strip()), text))
    if default is None:
        raise ValueError(f"routing: no default scheme in {spec!r}; add one item without '->', e.g. "
                         f"'{spec.strip().rstrip(';')}; thc'")
    return RoutingSpec(tuple(rules), default, min_numel)
