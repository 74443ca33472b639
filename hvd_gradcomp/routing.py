"""Routing: which scheme sends each tensor, decided once per tensor, in one place.

A compressor holds a :class:`Routing` (ordered rules, a default scheme, a size threshold
``min_numel``; its text form, the compressor spec, is :mod:`~hvd_gradcomp.routing_spec`'s) and
a :class:`RouteTable`, which asks the routing the first time it sees a tensor (its state key)
and keeps the answer (a :class:`Route`) for the compressor's lifetime; a checkpoint records
it. Decision, for a tensor with name ``name``, ``d`` coordinates and static facts ``info``:

    1. The rules in order: the first whose selector matches (fnmatch glob on ``name``,
       case-sensitive, and/or bounds on ``d``) sends the tensor with its scheme, whatever
       ``min_numel`` says (a rule is explicit).
    2. Else, ``d < min_numel``: the fallback, :data:`FALLBACK` (fp16, pre-scaled by 1/n).
       Default ``min_numel``: the default scheme's class attribute ``min_numel`` (1024 for
       ``thc``, ``topkc`` and ``auto``; 1, i.e. no size routing, for the others).
    3. Else the default scheme.
    4. A scheme chosen in 1 or 3 that does not accept the tensor
       (:meth:`~hvd_gradcomp.base.Scheme.accepts`: PowerSGD takes only the matrices it can
       shrink at its rank) hands it to its ``fallback_spec`` (fp16; ``none:dtype=float32`` for PowerSGD with
       ``uncompressed_dtype=float32``).

This is the only place that decides by size and shape: no scheme has a threshold or a
pass-through of its own, each compresses whatever the routing sends it. ``min_numel`` is a
routing option that every compressor spec and Python factory accepts
(``"thc:min_numel=512"``, ``Compression.thc(min_numel=512)``, ``Compression.rules(...,
min_numel=512)``); it is never passed to a scheme's config.

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
  the first step (:meth:`RouteTable.route`): it decides the route of each variable and
  compares the decisions of all ranks through one object gather (a rank-dependent routing
  raises ``ValueError`` on every rank, naming the position, each rank's name and rule). A
  gradient of a variable not given to ``route()`` raises ``ValueError`` at its first
  ``compress``, before any collective. Rules with size terms only (``numel>=N``) and
  ``min_numel`` need no names.
"""
from typing import NamedTuple

from .base import FALLBACK, Scheme, TensorInfo, passes_through
from .options import MIN_NUMEL, ROUTING_OPTION, to_spec
from .registry import make_scheme, parse_spec
from .routing_spec import (RULE_ARROW, RoutingSpec, Selector, format_selector, parse_routing, parse_selector,
                           split_min_numel, with_min_numel)

__all__ = ["Route", "Routing", "RouteTable", "FALLBACK", "scheme_text", "canonical_text", "NEEDS_NAME",
           "TRANSFORMER_FP16", "transformer_spec",
           # the grammar (hvd_gradcomp.routing_spec), re-exported
           "RULE_ARROW", "RoutingSpec", "Selector", "format_selector", "parse_routing", "parse_selector",
           "split_min_numel", "with_min_numel"]

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
_NEEDS_ROUTE = ("{spec!r}: rules match variable names, which TensorFlow does not keep equal across "
                "ranks (Keras numbers layers per process); call compressor.route(variables) on every "
                "rank before the first step, so the ranks' routes are compared once; variable "
                "{name!r} (gradient {key!r}) was not given to route()")
ROUTE_MISMATCH = ("{spec!r}: tensor {key!r} was routed to {saved!r} in the checkpoint, and this "
                  "compressor routes it to {now!r} ({why}); load the checkpoint into a compressor "
                  "whose rules route it alike")


def scheme_text(scheme: Scheme) -> str:
    """A scheme's canonical spec (:func:`~hvd_gradcomp.options.to_spec`; never a
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
        ``len(rules) + 1`` for a fallback (below ``min_numel``, or not accepted).
    scheme: the scheme that sends the tensor.
    text: :func:`scheme_text` of that scheme (stored in checkpoints, compared at load).
    why: which rule decided, for messages (``"rule 1 '*embed*'"``, ``"default"``,
        ``"numel < min_numel=1024"``, ``"default: powersgd does not accept float32[10]"``).
    refused: the text of the scheme that did not accept the tensor, or "" (a checkpoint
        that recorded that scheme for it still loads).
    """

    index: int
    scheme: Scheme
    text: str
    why: str
    refused: str = ""


class _Rule(NamedTuple):
    selector: Selector
    scheme: Scheme
    text: str


def _build(spec: str) -> Scheme:
    """A scheme from its spec text (without ``min_numel``). Raises ValueError as
    :func:`~hvd_gradcomp.registry.parse_spec`."""
    name, options = parse_spec(spec)
    return make_scheme(name, **options)


def _no_separator(text: str, what: str, where: str):
    """Refuse a ``;`` or ``->`` inside one part of a Python rule (they would split it)."""
    for sep in (";", RULE_ARROW):
        if sep in text:
            role = "between rules" if sep == ";" else "between a selector and its scheme"
            raise ValueError(f"{where}: the {what} holds {sep!r}, a separator of the spec text "
                             f"({role}); give each rule as its own (selector, scheme spec) pair")


def _text_of(spec, what: str, where: str, rule: bool) -> str:
    """The spec text of a rule's scheme or the default (``rule=False``): a spec string as it
    is, a compressor of one scheme as its spec (a rule's without ``min_numel``). Raises
    ValueError (:meth:`Routing.from_rules`)."""
    routing = getattr(spec, "routing", None)
    if isinstance(routing, Routing):
        if routing.rules:
            raise ValueError(f"{where}: compressor {routing.spec()!r} routes by rules of its own; "
                             f"the {what} must be one scheme (list its rules here instead)")
        if rule and routing.min_numel != routing.default.min_numel:
            raise ValueError(f"{where}: compressor {routing.spec()!r} has min_numel={routing.min_numel}, "
                             f"the default's threshold; in a rule use a size term "
                             f"('numel>={routing.min_numel}') and a compressor without min_numel")
        return scheme_text(routing.default) if rule else routing.spec()
    if not isinstance(spec, str):
        factory = callable(spec) and repr(spec).startswith("Compression.")  # namespace.Factory
        raise ValueError(f"{where}: the {what} must be a scheme spec string ('fp16') or a compressor "
                         f"of one scheme (Compression.fp16()), got {type(spec).__name__} {spec!r}"
                         + (f"; call it: {spec!r}()" if factory else ""))
    _no_separator(spec, what, where)
    return spec


class Routing:
    """Rules, default scheme and size threshold (module docstring); decides routes.

    Build with :meth:`single` (one scheme, as ``Compression.thc()``), :meth:`from_rules`
    (Python) or :meth:`from_spec` (text, grammar in :mod:`hvd_gradcomp.routing_spec`).
    """

    __slots__ = (
        # configuration
        "rules", "default", "min_numel",
        # spec -> scheme: FALLBACK and the fallbacks of the rules' and default's schemes
        "fallbacks",
        # True for a single scheme as the user built it (no rules): the compressor's repr
        # shows every option of it
        "plain",
    )

    def __init__(self, rules, default: Scheme, min_numel: int, plain: bool = False):
        MIN_NUMEL.check(default.name, ROUTING_OPTION, min_numel)
        self.rules = tuple(rules)
        self.default = default
        self.min_numel = MIN_NUMEL.normalise(min_numel)
        self.fallbacks = {}
        for spec in [FALLBACK] + [s.fallback_spec for s in [r.scheme for r in self.rules] + [default]]:
            if spec not in self.fallbacks:
                self.fallbacks[spec] = _build(spec)
        self.plain = plain

    @classmethod
    def single(cls, scheme: Scheme, min_numel=None) -> "Routing":
        """All tensors to ``scheme`` except those below ``min_numel`` (fp16) and those it does
        not accept (its fallback).

        Args:
            scheme: the scheme of every tensor with at least ``min_numel`` coordinates.
            min_numel: an integer >= 1; None (default): the scheme's ``min_numel``.

        Raises:
            ValueError: ``min_numel`` is not an integer >= 1.
        """
        return cls((), scheme, scheme.min_numel if min_numel is None else min_numel, plain=True)

    @classmethod
    def from_rules(cls, rules, default="thc", min_numel=None) -> "Routing":
        """Routing from Python values.

        Args:
            rules: a list (any iterable) of ``(selector, scheme)`` pairs, tried in order, e.g.
                ``("*.bias", "fp16")``, ``("*embed* numel>=4096", "topkc:0.01")``,
                ``("numel>=1e6", "powersgd:4")`` (selector grammar:
                :mod:`hvd_gradcomp.routing_spec`). A selector is a string or a
                :class:`Selector`; a scheme is a spec string or a compressor of one scheme
                (``Compression.fp16()``, ``Compression.topkc(0.01)``), whose spec is used (its
                options; not its state, which stays with that object).
            default: scheme spec (may hold ``min_numel=N``) or compressor of one scheme (its
                ``min_numel`` kept) for tensors no rule names.
            min_numel: tensors no rule names with fewer coordinates go as fp16; an integer
                >= 1; default: the default scheme's ``min_numel``.

        Raises:
            ValueError: naming the rule (its index and pair): ``rules`` is a string, dict or
                non-iterable, or holds something other than pairs; a selector, scheme or default of another type (None, a number, a
                factory such as ``Compression.fp16`` without the call); a compressor with rules
                of its own, or one with a ``min_numel`` of its own as a rule's scheme; a ``;``
                or ``->`` inside a selector, scheme or default (they separate rules in a spec:
                one pair is one rule); a malformed selector or spec; ``min_numel`` given twice
                or inside a rule's spec.
        """
        if isinstance(rules, (str, bytes, dict)) or not hasattr(rules, "__iter__"):
            raise ValueError(f"routing: rules must be a list of (selector, scheme spec) pairs, "
                             f"got {type(rules).__name__} {rules!r}")
        text, inner = split_min_numel(_text_of(default, "default", "routing", rule=False))
        if inner is not None and min_numel is not None:
            raise ValueError(f"routing: min_numel given twice (min_numel={min_numel} and in "
                             f"default {default!r})")
        items = []
        for i, rule in enumerate(rules):
            if isinstance(rule, (str, bytes)) or not isinstance(rule, (list, tuple)) or len(rule) != 2:
                raise ValueError(f"routing: rule {i} must be a (selector, scheme spec) pair, got {rule!r}")
            selector, spec = rule
            where = f"routing: rule {i} {tuple(rule)!r}"
            if isinstance(selector, Selector):
                selector = format_selector(selector)
            elif not isinstance(selector, str):
                raise ValueError(f"{where}: the selector must be a string (a glob and/or numel "
                                 f"bounds) or a Selector, got {type(selector).__name__}")
            _no_separator(selector, "selector", where)
            items.append(f"{selector} {RULE_ARROW} {_text_of(spec, 'scheme', where, rule=True)}")
        threshold = min_numel if min_numel is not None else inner
        items.append(text if threshold is None else with_min_numel(text, threshold))
        return cls.from_spec("; ".join(items))

    @classmethod
    def from_spec(cls, spec: str) -> "Routing":
        """Routing from a compressor spec (grammar: :mod:`hvd_gradcomp.routing_spec`).
        Raises ValueError as :func:`~hvd_gradcomp.routing_spec.parse_routing`."""
        parsed = parse_routing(spec)
        if not parsed.rules:
            return cls.single(_build(parsed.default), parsed.min_numel)
        rules = []
        for selector, text in parsed.rules:
            scheme = _build(text)
            rules.append(_Rule(selector, scheme, scheme_text(scheme)))
        default = _build(parsed.default)
        return cls(rules, default, default.min_numel if parsed.min_numel is None else parsed.min_numel)

    # ---- what it holds ----
    def schemes(self):
        """Every scheme a route may use: the rules', the default, the fallbacks."""
        return [r.scheme for r in self.rules] + [self.default] + list(self.fallbacks.values())

    def bind(self, ops) -> "Routing":
        """Hand the backend's primitives to every scheme (:meth:`Scheme.bind`); returns self."""
        self.default = self.default.bind(ops)
        self.rules = tuple(r._replace(scheme=r.scheme.bind(ops)) for r in self.rules)
        self.fallbacks = {spec: s.bind(ops) for spec, s in self.fallbacks.items()}
        return self

    def needs_names(self) -> bool:
        """True if some rule matches on names (a glob other than ``*``)."""
        return any(r.selector.pattern != "*" for r in self.rules)

    def spec(self) -> str:
        """The canonical compressor spec; :meth:`from_spec` of it gives an equal routing.
        ``min_numel`` is the default's last option, written only where it differs from the
        default scheme's own (``"thc"``, ``"thc:bits=2,min_numel=512"``,
        ``"topk:ratio=0.1,min_numel=1024"``)."""
        text = scheme_text(self.default)
        if self.min_numel != self.default.min_numel:
            text = with_min_numel(text, self.min_numel)
        rules = [f"{format_selector(r.selector)} {RULE_ARROW} {r.text}" for r in self.rules]
        return "; ".join(rules + [text])

    # ---- the decision ----
    def decide(self, name, tensor) -> Route:
        """The route of a tensor called ``name`` (None: unknown): module docstring, steps 1-4.

        Args:
            name: what the rules' globs match.
            tensor: its :class:`~hvd_gradcomp.base.TensorInfo`; or an int, its number of
                coordinates, for a question on names and sizes only (step 4 is then skipped).

        Raises:
            ValueError: the tensor has no name and a rule with a glob would need it.
        """
        info = tensor if isinstance(tensor, TensorInfo) else None
        numel = tensor if info is None else info.numel
        for i, rule in enumerate(self.rules):
            if rule.selector.pattern != "*" and name is None:
                raise ValueError(NEEDS_NAME.format(routing=self.spec()))
            if rule.selector.matches(name, numel):
                return self._accepted(Route(i, rule.scheme, rule.text,
                                            f"rule {i} {format_selector(rule.selector)!r}"), info)
        if numel < self.min_numel:
            small = self.fallbacks[FALLBACK]
            return Route(len(self.rules) + 1, small, scheme_text(small), f"numel < min_numel={self.min_numel}")
        return self._accepted(Route(len(self.rules), self.default, scheme_text(self.default), "default"), info)

    def _accepted(self, route: Route, info) -> Route:
        """``route``, or its scheme's fallback if that scheme does not accept ``info`` (and
        :data:`FALLBACK`, which takes every tensor, if the fallback does not either)."""
        if info is None or route.scheme.accepts(info):
            return route
        fallback = self.fallbacks[route.scheme.fallback_spec]
        if not fallback.accepts(info):
            fallback = self.fallbacks[FALLBACK]
        return Route(len(self.rules) + 1, fallback, scheme_text(fallback),
                     f"{route.why}: {route.scheme.name} does not accept {info.dtype}{list(info.shape)}",
                     route.text)

    def __repr__(self):
        return f"Routing({self.spec()!r})"


class RouteTable:
    """The route of each tensor a compressor has seen, decided once by its :class:`Routing`.

    Attributes:
        routing: the :class:`Routing`.
        routes: ``{key: Route}`` of the tensors seen (or given to :meth:`route` by name).
        pins: ``{pin: Route}`` fixed by :meth:`route` (TensorFlow: per variable ``ref()``).
        saved: ``{key: scheme text}`` loaded from a checkpoint for tensors not yet seen;
            compared with the decision at their first :meth:`of`.
        superseded: keys whose checkpoint recorded the scheme that now refuses them
            (:attr:`Route.refused`; e.g. a vector PowerSGD once passed through itself): the
            state saved for them is that scheme's, not the fallback's, and the adapter drops it.
    """

    __slots__ = ("routing", "routes", "pins", "saved", "superseded")

    def __init__(self, routing: Routing):
        self.routing, self.routes, self.pins, self.saved = routing, {}, {}, {}
        self.superseded = set()

    def of(self, key, name, pin, info: TensorInfo) -> Route:
        """The route of tensor ``key`` (None: unknown, decided afresh each time): decided at
        its first call, then the same at every step.

        Args:
            key: the state key; name: what the rules match; pin: the handle :meth:`route`
                stored the decision under (TensorFlow variables), or None.
            info: the tensor's static facts (for :meth:`~hvd_gradcomp.base.Scheme.accepts`).

        Raises:
            ValueError: rules on names and a pinned tensor that :meth:`route` never saw; a
                route that differs from the checkpoint's; no name where a rule needs one.
        """
        route = self.routes.get(key) if key is not None else None
        if route is not None:
            return route
        if pin is not None and self.routing.needs_names():
            route = self.pins.get(pin)
            if route is None:
                raise ValueError(_NEEDS_ROUTE.format(spec=self.routing.spec(), name=name, key=key))
        else:
            route = self.routing.decide(name, info)
        if key is not None:
            saved = self.saved.pop(key, None)
            if saved is not None:
                self._check_saved(key, saved, route)
            self.routes[key] = route
        return route

    def _check_saved(self, key, saved: str, route: Route):
        if saved not in (route.text, route.refused):
            raise ValueError(ROUTE_MISMATCH.format(spec=self.routing.spec(), key=key, saved=saved,
                                                   now=route.text, why=route.why))
        if saved != route.text:
            self.superseded.add(key)

    def load(self, routes: dict):
        """Take a checkpoint's ``{key: scheme text}``: compared now for the tensors seen, at
        their first :meth:`of` for the others. Raises ValueError (naming the tensor, both
        schemes and the rule) where they differ."""
        for key, text in routes.items():
            text = canonical_text(text)
            route = self.routes.get(key)
            if route is None:
                self.saved[key] = text
            else:
                self._check_saved(key, text, route)

    def texts(self) -> dict:
        """``{key: scheme text}`` of every tensor seen, then of those loaded and not yet seen."""
        out = {key: route.text for key, route in self.routes.items()}
        for key, text in self.saved.items():
            out.setdefault(key, text)
        return out

    def route(self, items, gather=None) -> list:
        """Decide each parameter's route now and, with ``gather``, check that every rank
        decides alike (module docstring).

        Args:
            items: ``(name, shape tuple, dtype string, pin)`` per parameter, in the model's
                order (the same on every rank); ``pin``: the handle :meth:`of` will be given
                for its gradient (TensorFlow's variable ``ref()``), or None.
            gather: ``obj -> [obj of rank 0, 1, ...]`` on every rank (the engine's object
                gather), or None to decide locally, without a collective.

        Returns:
            ``[(name, scheme spec or None), ...]`` in the order given; None for tensors that
            pass through untouched (non-float or empty).

        Raises:
            ValueError, on every rank: the ranks route some parameter differently (naming its
            position and each rank's name and rule), or give different numbers of parameters.
        """
        items = list(items)
        table, routes = [], []
        for name, shape, dtype, _ in items:
            info = TensorInfo(name, tuple(shape), dtype, 1, 0)
            route = None if passes_through(dtype, info.numel) else self.routing.decide(name, info)
            routes.append(route)
            table.append((name, None if route is None else route.text,
                          "passes through" if route is None else route.why))
        if gather is not None:
            self._check_same(gather(table))
        for (_, _, _, pin), route in zip(items, routes):
            if pin is not None and route is not None:
                self.pins[pin] = route
        return [(name, text) for name, text, _ in table]

    def _check_same(self, tables):
        """Raise ValueError (the same on every rank: each holds every table) if they differ."""
        spec, count = self.routing.spec(), len(tables[0])
        for r, table in enumerate(tables):
            if len(table) != count:
                raise ValueError(f"{spec!r}: route() got {count} parameters on rank 0 and "
                                 f"{len(table)} on rank {r}; every rank must pass the same model's")
        for i in range(count):
            if len({table[i][1] for table in tables}) > 1:
                detail = "; ".join(f"rank {r}: {table[i][0]!r} -> {table[i][1] or 'untouched'} "
                                   f"({table[i][2]})" for r, table in enumerate(tables))
                raise ValueError(f"{spec!r}: the ranks route parameter {i} differently ({detail}), "
                                 f"which would pair payloads of different schemes; use rules that "
                                 f"match the same way on every rank's names, or build the model "
                                 f"identically on every rank")
