"""``Compression``: the namespace each backend offers (``torch_backend.Compression``,
``tf_backend.Compression``), built from the catalogue (:data:`~hvd_gradcomp.registry.SCHEMES`)
over that backend's compressor class, so both frameworks offer the same names and options.

``Compression.<name>(**options)`` makes a compressor for one scheme, ``Compression.from_spec``
one from a text spec, ``Compression.rules`` one that routes tensors by name and size.
"""
from .registry import SCHEMES, make_scheme
from .routing import Routing

__all__ = ["Namespace", "Factory"]


class Factory:
    """``Compression.<name>``: call it with the scheme's options to get a new compressor.

    Each call returns a new object with its own per-tensor state; give each optimizer its
    own. Passing the factory itself (Horovod's ``compression=hvd.Compression.fp16`` habit)
    raises a TypeError that says so.
    """

    def __init__(self, compressor_cls, name):
        self._cls, self.name = compressor_cls, name
        self.__doc__ = f"A new {name} compressor; options: see {SCHEMES[name][0].__name__}."

    def __call__(self, *args, **options):
        """A new compressor; ``min_numel`` (tensors with fewer coordinates go as fp16; an
        integer >= 1, default the scheme's ``min_numel``) is a routing
        option accepted by every scheme (module :mod:`~hvd_gradcomp.routing`); the other
        options go to the scheme's config. Raises ValueError for an unknown or bad option."""
        min_numel = options.pop("min_numel", None)
        return self._cls(Routing.single(make_scheme(self.name, *args, **options), min_numel))

    def compress(self, tensor, *args, **kwargs):
        raise TypeError(f"Compression.{self.name} is a factory: pass Compression.{self.name}() "
                        f"(with options, if any) as compression=")

    decompress = compress

    def __repr__(self):
        return f"Compression.{self.name}"


class Namespace:
    """``Compression.<name>(**options)`` for every scheme, plus ``from_spec`` and ``names``."""

    def __init__(self, compressor_cls):
        self._cls = compressor_cls

    def __getattr__(self, name):
        if not name.startswith("_") and name.lower() in SCHEMES:
            name = name.lower()
        if name.startswith("_") or name not in SCHEMES:
            raise AttributeError(f"Compression has no compressor {name!r}; "
                                 f"expected one of {sorted(SCHEMES)}")
        return Factory(self._cls, name)

    def from_spec(self, spec: str):
        """A compressor from a text spec: a scheme (``"topkc:ratio=0.01,chunk=256"``) or rules
        (``"*.bias -> fp16; *embed* -> topkc:0.01; thc:min_numel=4096"``; grammar in
        :mod:`hvd_gradcomp.routing_spec`). Raises ValueError for a malformed spec."""
        return self._cls(Routing.from_spec(spec))

    def rules(self, rules, default="thc", min_numel=None):
        """A compressor that routes each tensor by name and size (:mod:`hvd_gradcomp.routing`).

        Args:
            rules: ``[(selector, scheme), ...]`` tried in order, e.g.
                ``[("*.bias", "fp16"), ("*embed*", Compression.topkc(0.01)), ("numel>=1e6",
                "powersgd:4")]``; a selector is an fnmatch glob on the tensor's name and/or
                ``numel>=N`` / ``numel<N`` terms; a scheme is a spec string or a compressor of
                one scheme, whose spec is used (not its state).
            default: scheme spec or compressor of one scheme for tensors no rule names
                (default ``"thc"``).
            min_numel: tensors no rule names with fewer coordinates go as fp16; an integer
                >= 1; default: the default scheme's ``min_numel`` (1024 for ``thc``,
                ``topkc``, ``auto``; else 1).

        In TensorFlow, rules with a glob need ``compressor.route(variables)`` before the first
        step (variable names may differ between ranks). Raises ValueError for a malformed
        rule, naming it: a value of another type, a ``;`` or ``->`` inside a pair, a
        compressor with rules of its own (:meth:`hvd_gradcomp.routing.Routing.from_rules`).
        """
        return self._cls(Routing.from_rules(rules, default, min_numel))

    def names(self):
        """The compressor names offered (same in both frameworks)."""
        return sorted(SCHEMES)

    def __dir__(self):
        return sorted(SCHEMES) + ["from_spec", "names", "rules"]
