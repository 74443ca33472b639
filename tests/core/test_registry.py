"""The catalogue and text specs (hvd_gradcomp/registry.py): names, options, canonical specs,
construction errors, and both frontends offering the same compressors."""
import dataclasses

import pytest

from hvd_gradcomp.registry import SCHEMES, make_scheme, parse_spec, to_spec
from hvd_gradcomp.routing import Routing
from tests.backends import requires_backend


def test_spec_round_trip():
    assert parse_spec("topkc:ratio=0.01,chunk=256") == ("topkc", {"ratio": 0.01, "chunk": 256})
    assert parse_spec(" topkc : ratio = 0.5 , error_feedback = false ") == (
        "topkc", {"ratio": 0.5, "error_feedback": False})
    assert parse_spec("fp32") == ("none", {})
    for name in SCHEMES:
        scheme = make_scheme(name)
        assert to_spec(scheme) == name
        n, opts = parse_spec(to_spec(scheme))
        assert make_scheme(n, **opts).config == scheme.config
    s = make_scheme("topkc", ratio=0.1, chunk=64, selection="current")
    assert to_spec(s) == "topkc:ratio=0.1,chunk=64,selection=current"
    assert make_scheme(*[parse_spec(to_spec(s))[0]], **parse_spec(to_spec(s))[1]).config == s.config
    # The defaults: single-collective selection, not in the spec.
    default = make_scheme("topkc")
    assert default.config.selection == "previous"
    assert to_spec(make_scheme("topkc", selection="previous")) == "topkc"
    assert not default.blocking and s.blocking
    # fp16 below 1024 coordinates is the routing's default for topkc and thc, not a scheme
    # option: no config has min_numel.
    assert not any(f.name == "min_numel" for config, _ in SCHEMES.values() for f in dataclasses.fields(config))
    assert Routing.from_spec("topkc").min_numel == Routing.single(default).min_numel == 1024
    assert Routing.from_spec("topkc:ratio=0.1,min_numel=1").spec() == "topkc:ratio=0.1,min_numel=1"


@pytest.mark.parametrize("spec,message", [
    ("topkc:ratio=1.5", "topkc: ratio must be a number in (0, 1], got 1.5"),
    ("topkc:ratio=0", "topkc: ratio must be a number in (0, 1], got 0.0"),
    ("topk:ratio=-0.1", "topk: ratio must be a number in (0, 1], got -0.1"),
    ("topkc:chunk=0", "topkc: chunk must be an integer >= 1, got 0"),
    ("topkc:payload_dtype=int8", "topkc: payload_dtype must be 'float16' or 'float32'"),
    ("topkc:selection=lagged", "topkc: selection must be 'previous' or 'current', got 'lagged'"),
    ("topkc:min_numel=1024", "topkc: unknown option 'min_numel'"),  # a routing option (below)
    ("topkc:rank=2", "topkc: unknown option 'rank'"),
    ("topkc:chunk=8,ratio", "topkc: expected key=value in spec 'topkc:chunk=8,ratio', got 'ratio'"),
    ("topkc:ratio", "topkc: ratio must be a number in (0, 1], got 'ratio'"),  # a bare first value is the ratio
    ("topkc:ratio=abc", "topkc: ratio must be a number in (0, 1], got 'abc'"),
    ("topkc:error_feedback=maybe", "topkc: error_feedback must be true, false or ef21, got 'maybe'"),
    ("thc:error_feedback=ef21", "thc: error_feedback must be true or false, got 'ef21'"),
    ("zip", "unknown compressor 'zip'"),
])
def test_bad_specs_raise_value_error(spec, message):
    with pytest.raises(ValueError) as err:
        name, opts = parse_spec(spec)
        make_scheme(name, **opts)
    assert message in str(err.value)


@pytest.mark.parametrize("spec,message", [
    ("topkc:min_numel=0", "topkc: min_numel must be an integer >= 1, got 0"),
    ("topkc:min_numel=1.5", "topkc: min_numel must be an integer >= 1, got '1.5'"),
    ("topkc:chunk=0,min_numel=4", "topkc: chunk must be an integer >= 1, got 0"),
])
def test_bad_compressor_specs_raise_value_error(spec, message):
    """min_numel is checked where a compressor spec is read (the routing)."""
    with pytest.raises(ValueError) as err:
        Routing.from_spec(spec)
    assert message in str(err.value)


def test_bad_keyword_options_raise_value_error():
    with pytest.raises(ValueError, match="unknown option"):
        make_scheme("topk", chunk=3)
    with pytest.raises(ValueError, match="ratio must be a number in"):
        make_scheme("topk", ratio=True)


def test_an_option_given_twice_is_refused_with_one_message_everywhere():
    """In a spec, in a call, positional and by name, and min_numel in a routing spec."""
    calls = [lambda: parse_spec("topkc:ratio=0.1,ratio=0.5"), lambda: parse_spec("topkc:0.1,ratio=0.5"),
             lambda: make_scheme("topkc", 0.1, ratio=0.5), lambda: Routing.from_spec("topkc:ratio=0.1,ratio=0.5"),
             lambda: Routing.from_spec("auto:every=10,every=20")]
    messages = []
    for call in calls:
        with pytest.raises(ValueError) as err:
            call()
        messages.append(str(err.value))
    assert messages == ["topkc: ratio given twice"] * 4 + ["auto: every given twice"]
    with pytest.raises(ValueError) as err:
        Routing.from_spec("thc:min_numel=5,min_numel=6")
    assert str(err.value) == "thc: min_numel given twice"


@requires_backend("torch")
@requires_backend("tensorflow")
def test_frontends_offer_the_same_compressors():
    import tf_backend
    import torch_backend
    assert torch_backend.Compression.names() == tf_backend.Compression.names() == sorted(SCHEMES)
    for name in SCHEMES:
        a = getattr(torch_backend.Compression, name)()
        b = getattr(tf_backend.Compression, name)()
        assert a.spec == b.spec == name
        assert dataclasses.fields(a.scheme.config) == dataclasses.fields(b.scheme.config)
    c = torch_backend.Compression.from_spec("topkc:ratio=0.02,chunk=128")
    assert c.scheme.config.ratio == 0.02 and c.scheme.config.chunk == 128
    with pytest.raises(ValueError, match="ratio must be a number in"):
        tf_backend.Compression.topkc(ratio=2)
    with pytest.raises(AttributeError, match="no compressor 'zstd'"):
        torch_backend.Compression.zstd
    # Horovod's habit of passing the class attribute itself gets a clear message.
    with pytest.raises(TypeError, match=r"pass Compression.fp16\(\)"):
        torch_backend.Compression.fp16.compress(None)


def test_hooks_with_other_arguments_refused_at_register():
    """A scheme's composite hooks (hvd_gradcomp.composite) are found by name: one whose
    arguments differ from the call's, or an attribute of a hook's name that is not a method,
    is refused when the scheme is registered, not when auto or a checkpoint first calls it."""
    from hvd_gradcomp import composite
    from hvd_gradcomp.cast import Fp16Config, Fp16Scheme
    from hvd_gradcomp.registry import register
    from hvd_gradcomp.warmup import WarmupScheme
    for _, scheme_cls in SCHEMES.values():
        composite.check_hooks(scheme_cls)  # the catalogue's hooks take what they are given
    composite.check_hooks(WarmupScheme)

    class NoState(Fp16Scheme):
        def metrics(self):
            return {}

    class Swapped(Fp16Scheme):
        def add_residual(self, ops, state, residual):
            return state

    class Flag(Fp16Scheme):
        forget = True

    class Fine(Fp16Scheme):
        def residual_of(self, ops, state, info, extra=None):
            return None

        @staticmethod
        def payload_dtype(info):
            return "float16"

    for cls, message in ((NoState, "NoState.metrics(self): hvd_gradcomp.composite calls this hook as "
                                   "NoState.metrics(self, state)"),
                         (Swapped, "Swapped.add_residual(self, ops, state, residual): hvd_gradcomp.composite "
                                   "calls this hook as Swapped.add_residual(self, ops, state, info, residual)"),
                         (Flag, "Flag.forget is a bool, and hvd_gradcomp.composite calls it as the hook "
                                "Flag.forget(self, key); rename it")):
        with pytest.raises(TypeError) as err:
            register("fp16", Fp16Config, cls)
        assert str(err.value) == message
        assert SCHEMES["fp16"] == (Fp16Config, Fp16Scheme)  # nothing registered
    composite.check_hooks(Fine)
