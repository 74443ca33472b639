"""Routing: which scheme sends each tensor, decided once per tensor, in one place.

A compressor holds a :class:`Routing`: ordered rules, a default scheme and a size threshold
``min_numel``. The adapter asks it the first time it sees a tensor (its state key) and keeps
the answer (a :class:`Route`) with the tensor's state for the compressor's lifetime; a
checkpoint records it. Decision, for a tensor with name ``name`` and ``d`` coordinates:

    1. The rules in order: the first whose selector matches (fnmatch glob on ``name``,
       case-sensitive, and/or bounds on ``d``) sends the tensor with its scheme, whatever
       ``min_numel`` says (a rule is explicit).
    2. Else, ``d < min_numel``: fp16 (:data:`~hvd_gradcomp.registry.SMALL_SCHEME`), pre-scaled
       by 1/n. Default ``min_numel``: 1024 with ``thc``/``topkc`` as the default scheme, 1 (no
       size routing) otherwise (:data:`~hvd_gradcomp.registry.SMALL_DEFAULTS`).
    3. Else the default scheme.

This is the only place that decides by size: no scheme has a size threshold of its own, each
compresses whatever the routing sends it. ``min_numel`` is a routing option that every
compressor spec and Python factory accepts (``"thc:min_numel=512"``,
``Compression.thc(min_numel=512)``, ``Compression.rules(..., min_numel=512)``); it is never
passed to a scheme's config. PowerSGD's matrix-shape policy (vectors and matrices it cannot
shrink go as float16) stays in the scheme: it depends on the kernel layout and rank, not only
on the size.

Names the rules see (what makes a decision identical on every rank):

- PyTorch: the parameter's name as ``hvd.DistributedOptimizer`` got it from
  ``named_parameters`` (e.g. ``"encoder.layers.0.linear1.weight"``; without
  ``named_parameters``, Horovod's ``"allreduce.noname.<i>"``), or ``name=`` of
  ``hvd.allreduce``. These are Horovod's own collective names, equal on every rank or
  Horovod would not pair the collectives, so a routing by name is rank-independent by
  construction.
- TensorFlow ``hvd.allreduce(name=...)``: that name, likewise.
- TensorFlow ``DistributedGradientTape`` / ``DistributedOptimizer``: the variable's name
  (``var.name``, e.g. ``"dense/kernel:0"``). Horovod names these collectives by position
  (``grad_<j>``, also our state key), so it does not need variable names to agree, and they
  may not: Keras numbers layer names per process (a rank that built another model first has
  ``"dense_1/kernel:0"`` where the others have ``"dense/kernel:0"``), eager variables may share
  names. Rules with a glob therefore need ``compressor.route(variables)`` on every rank before
  the first step: it decides the route of each variable and compares the decisions of all
  ranks with one ``hvd.broadcast_object`` per rank (a rank-dependent routing raises ``ValueError`` on
  every rank, naming the position, each rank's name and rule). A gradient of a variable not
  given to ``route()`` raises ``ValueError`` at its first ``compress``, before any
  collective. Rules with size terms only (``numel>=N``) and ``min_numel`` need no names.
"""
from typing import NamedTuple

from .base import Scheme
from .registry import (MIN_NUMEL, ROUTING_OPTION, RULE_ARROW, SMALL_SCHEME, Selector, format_selector,
                       make_scheme, parse_routing, parse_spec, small_default, split_min_numel, to_spec,
                       with_min_numel)

__all__ = ["Route", "Routing", "scheme_text", "canonical_text", "NEEDS_NAME", "TRANSFORMER_FP16",
           "transformer_spec"]

# Rules that keep a transformer's embeddings, norms, biases and output head on fp16, as the
# recipes that compress transformers under Adam do (ZeRO++ qgZ, 1-bit Adam: 16 bits for these);
# for Compression.rules(TRANSFORMER_FP16, default=...) or transformer_spec(). Names as PyTorch's
# nn.Transformer/nn.Embedding/nn.LayerNorm and Hugging Face models give them (wte/wpe: GPT-2's
# embeddings, ln_*: its norms, LayerNorm: BERT's; *pos: a positional table named pos, as in
# the benchmark's LM). Why: an embedding's gradient touches the
# rows of the batch's tokens only and a head's is dominated by a few rows (sparse, bursty under
# Top-K and badly approximated at low rank), and norms and biases are small vectors where any
# scheme's fixed costs outweigh its saving (docs/adam-compression.md).
TRANSFORMER_FP16 = (
    ("*embed*", "fp16"), ("*wte*", "fp16"), ("*wpe*", "fp16"), ("*pos", "fp16"),
    ("*norm*", "fp16"), ("*Norm*", "fp16"), ("*ln_*", "fp16"),
    ("*bias", "fp16"),
    ("*head*", "fp16"),
)


def transformer_spec(default: str) -> str:
    """The compressor spec ``TRANSFORMER_FP16``'s rules, then ``default`` (a scheme spec, may
    hold ``min_numel``/``fp16_warmup``) for every other tensor, e.g.
    ``transformer_spec("topkc:0.1,error_feedback=ef21")``. In TensorFlow, rules with globs need
    ``compressor.route(variables)`` first (module docstring)."""
    return "; ".join(f"{glob} {RULE_ARROW} {scheme}" for glob, scheme in TRANSFORMER_FP16) + "; " + default

NEEDS_NAME = ("{routing!r}: rules match tensor names, and this tensor has none; use the compressor "
              "through Horovod's optimizers, pass name= to hvd.allreduce, or call compress(tensor, "
              "name=...)")


def scheme_text(scheme: Scheme) -> str:
    """A scheme's canonical spec (:func:`~hvd_gradcomp.registry.to_spec`; never a
    ``min_numel``, which the routing owns), e.g. ``"topkc:ratio=0.01"``: what a route and a
    checkpoint record."""
    return to_spec(scheme)


def canonical_text(text: str) -> str:
    """A recorded scheme text (a checkpoint's route) as :func:`scheme_text` writes it today,
    so texts written before booleans were spelled ``true``/``false`` (``"thc:saturation=False"``)
    still compare equal; a text that no longer parses is returned as it is (and then differs)."""
    try:
        return scheme_text(_build(text))
    except (ValueError, TypeError):
        return text


class Route(NamedTuple):
    """The decision for one tensor.

    index: position of the rule that matched (0-based); ``len(rules)`` for the default,
        ``len(rules) + 1`` for the fp16 route of tensors below ``min_numel``.
    scheme: the scheme that sends the tensor.
    text: :func:`scheme_text` of that scheme (stored in checkpoints, compared at load).
    why: which rule decided, for messages (``"rule 1 '*embed*'"``, ``"default"``,
        ``"numel < min_numel=1024"``).
    """

    index: int
    scheme: Scheme
    text: str
    why: str


class _Rule(NamedTuple):
    selector: Selector
    scheme: Scheme
    text: str


def _build(spec: str) -> Scheme:
    """A scheme from its spec text (without ``min_numel``). Raises ValueError as
    :func:`~hvd_gradcomp.registry.parse_spec`."""
    name, options = parse_spec(spec)
    return make_scheme(name, **options)


class Routing:
    """Rules, default scheme and size threshold (module docstring); decides routes.

    Build with :meth:`single` (one scheme, as ``Compression.thc()``), :meth:`from_rules`
    (Python) or :meth:`from_spec` (text, grammar in :mod:`hvd_gradcomp.registry`).
    """

    __slots__ = (
        # configuration
        "rules", "default", "min_numel", "small",
        # True for a single scheme as the user built it (no rules): the compressor's repr
        # shows every option of it
        "plain",
    )

    def __init__(self, rules, default: Scheme, min_numel: int, plain: bool = False):
        MIN_NUMEL.check(default.name, ROUTING_OPTION, min_numel)
        self.rules = tuple(rules)
        self.default = default
        self.min_numel = min_numel
        self.small = make_scheme(SMALL_SCHEME)
        self.plain = plain

    @classmethod
    def single(cls, scheme: Scheme, min_numel=None) -> "Routing":
        """All tensors to ``scheme`` except those below ``min_numel`` (fp16).

        Args:
            scheme: the scheme of every tensor with at least ``min_numel`` coordinates.
            min_numel: an integer >= 1; None (default):
                :func:`~hvd_gradcomp.registry.small_default` of the scheme's name (1024 for
                thc/topkc, else 1).

        Raises:
            ValueError: ``min_numel`` is not an integer >= 1.
        """
        if min_numel is None:
            min_numel = small_default(scheme.name)
        return cls((), scheme, min_numel, plain=True)

    @classmethod
    def from_rules(cls, rules, default="thc", min_numel=None) -> "Routing":
        """Routing from Python values.

        Args:
            rules: sequence of ``(selector, scheme_spec)`` pairs, both strings, e.g.
                ``("*.bias", "fp16")``, ``("*embed* numel>=4096", "topkc:0.01")``,
                ``("numel>=1000000", "powersgd:4")`` (selector grammar:
                :mod:`hvd_gradcomp.registry`), tried in order.
            default: scheme spec for tensors no rule names; may hold ``min_numel=N``.
            min_numel: tensors no rule names with fewer coordinates go as fp16; an integer
                >= 1; default: 1024 for thc/topkc as default, else 1.

        Raises:
            ValueError: a malformed selector or spec, ``min_numel`` given twice or inside a
                rule's spec.
        """
        text, inner = split_min_numel(default)
        if inner is not None and min_numel is not None:
            raise ValueError(f"routing: min_numel given twice (min_numel={min_numel} and in "
                             f"default {default!r})")
        items = []
        for i, rule in enumerate(rules):
            if isinstance(rule, (str, bytes)) or len(rule) != 2:
                raise ValueError(f"routing: rule {i} must be a (selector, scheme spec) pair, got {rule!r}")
            selector, spec = rule
            items.append(f"{selector if isinstance(selector, str) else format_selector(selector)} "
                         f"{RULE_ARROW} {spec}")
        threshold = min_numel if min_numel is not None else inner
        items.append(text if threshold is None else with_min_numel(text, threshold))
        return cls.from_spec("; ".join(items))

    @classmethod
    def from_spec(cls, spec: str) -> "Routing":
        """Routing from a compressor spec (grammar: :mod:`hvd_gradcomp.registry`)."""
        parsed = parse_routing(spec)
        if not parsed.rules:
            return cls.single(_build(parsed.default), parsed.min_numel)
        rules = []
        for selector, text in parsed.rules:
            scheme = _build(text)
            rules.append(_Rule(selector, scheme, scheme_text(scheme)))
        default = _build(parsed.default)
        min_numel = parsed.min_numel if parsed.min_numel is not None else small_default(default.name)
        return cls(rules, default, min_numel)

    # ---- what it holds ----
    def schemes(self):
        """Every scheme a route may use: the rules', the default, fp16 for small tensors."""
        return [r.scheme for r in self.rules] + [self.default, self.small]

    def bind(self, ops) -> "Routing":
        """Hand the backend's primitives to every scheme (:meth:`Scheme.bind`); returns self."""
        self.default = self.default.bind(ops)
        self.rules = tuple(r._replace(scheme=r.scheme.bind(ops)) for r in self.rules)
        self.small = self.small.bind(ops)
        return self

    def needs_names(self) -> bool:
        """True if some rule matches on names (a glob other than ``*``)."""
        return any(r.selector.pattern != "*" for r in self.rules)

    def spec(self) -> str:
        """The canonical compressor spec; :meth:`from_spec` of it gives an equal routing.
        ``min_numel`` is the default's last option, written only where it differs from
        :func:`~hvd_gradcomp.registry.small_default` (``"thc"``, ``"thc:bits=2,min_numel=512"``,
        ``"topk:ratio=0.1,min_numel=1024"``)."""
        text = scheme_text(self.default)
        if self.min_numel != small_default(self.default.name):
            text = with_min_numel(text, self.min_numel)
        rules = [f"{format_selector(r.selector)} {RULE_ARROW} {r.text}" for r in self.rules]
        return "; ".join(rules + [text])

    # ---- the decision ----
    def decide(self, name, numel: int) -> Route:
        """The route of a tensor called ``name`` (None: unknown) with ``numel`` coordinates.

        Raises:
            ValueError: the tensor has no name and a rule with a glob would need it.
        """
        for i, rule in enumerate(self.rules):
            if rule.selector.pattern != "*" and name is None:
                raise ValueError(NEEDS_NAME.format(routing=self.spec()))
            if rule.selector.matches(name, numel):
                return Route(i, rule.scheme, rule.text, f"rule {i} {format_selector(rule.selector)!r}")
        if numel < self.min_numel:
            return Route(len(self.rules) + 1, self.small, scheme_text(self.small),
                         f"numel < min_numel={self.min_numel}")
        return Route(len(self.rules), self.default, scheme_text(self.default), "default")

    def __repr__(self):
        return f"Routing({self.spec()!r})"
