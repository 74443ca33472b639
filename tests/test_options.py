"""hvd_gradcomp.options: one rule per kind of option, one wording, in every scheme."""
import math

import pytest

from hvd_gradcomp.options import (WIRE_DTYPES, check_bool, check_choice, check_float, check_int,
                                  check_ratio, check_seed)
from hvd_gradcomp.powersgd import PowerSGDConfig
from hvd_gradcomp.thc import THCConfig
from hvd_gradcomp.topk import TopKConfig
from hvd_gradcomp.topkc import TopKCConfig


def message(check, *args, **kwargs):
    with pytest.raises(ValueError) as err:
        check(*args, **kwargs)
    return str(err.value)


def test_int():
    check_int("s", "n", 3, 1, 16)
    check_int("s", "n", 1, 1, 16)
    check_int("s", "n", -5)
    assert message(check_int, "s", "n", 17, 1, 16) == "s: n must be an integer in [1, 16], got 17"
    assert message(check_int, "s", "n", 0, lo=1) == "s: n must be an integer >= 1, got 0"
    assert message(check_int, "s", "n", 9, hi=8) == "s: n must be an integer <= 8, got 9"
    for bad in (2.0, True, "3", None):
        assert message(check_int, "s", "n", bad) == f"s: n must be an integer, got {bad!r}"


def test_float():
    check_float("s", "x", 1, 0.0, 1.0, lo_open=True)  # ints are numbers
    check_float("s", "x", math.inf, lo=1.0)  # no upper bound: inf passes
    check_float("s", "x", 0.0, 0.0, 1.0)
    assert (message(check_float, "s", "x", 0.0, 0.0, 0.5, lo_open=True)
            == "s: x must be a number in (0, 0.5], got 0.0")
    assert (message(check_float, "s", "x", 1.0, 0.0, 1.0, hi_open=True)
            == "s: x must be a number in [0, 1), got 1.0")
    assert message(check_float, "s", "x", 0.5, lo=1.0) == "s: x must be a number >= 1, got 0.5"
    assert message(check_float, "s", "x", 0.0, lo=0.0, lo_open=True) == "s: x must be a number > 0, got 0.0"
    assert message(check_float, "s", "x", 3, hi=2.5) == "s: x must be a number <= 2.5, got 3"
    for bad in (math.nan, True, "0.5", None):
        with pytest.raises(ValueError, match=r"^s: x must be a number in \(0, 1\], got "):
            check_ratio("s", "x", bad)


def test_bool_and_choice():
    check_bool("s", "b", False)
    for bad in (1, 0, "yes", None):
        assert message(check_bool, "s", "b", bad) == f"s: b must be True or False, got {bad!r}"
    check_choice("s", "c", "float32", WIRE_DTYPES)
    assert (message(check_choice, "s", "c", "bfloat16", WIRE_DTYPES)
            == "s: c must be 'float16' or 'float32', got 'bfloat16'")
    assert message(check_choice, "s", "c", "d", ("a", "b", "c")) == "s: c must be 'a', 'b' or 'c', got 'd'"
    assert message(check_choice, "s", "c", None, ("a",)) == "s: c must be 'a', got None"


def test_seed():
    check_seed("s", "seed", 0)
    check_seed("s", "seed", 2 ** 40)
    assert message(check_seed, "s", "seed", -1) == "s: seed must be an integer >= 0, got -1"


@pytest.mark.parametrize("config,name", [(TopKConfig, "topk"), (TopKCConfig, "topkc"),
                                         (THCConfig, "thc"), (PowerSGDConfig, "powersgd")])
def test_shared_options_share_one_rule(config, name):
    """error_feedback, seed and ratio are refused alike in every scheme that has them."""
    fields = config.__dataclass_fields__
    assert message(config, error_feedback="yes") == f"{name}: error_feedback must be True or False, got 'yes'"
    if "seed" in fields:
        assert message(config, seed=-1) == f"{name}: seed must be an integer >= 0, got -1"
        assert message(config, seed=1.0) == f"{name}: seed must be an integer >= 0, got 1.0"
    if "ratio" in fields:
        assert message(config, ratio=0.0) == f"{name}: ratio must be a number in (0, 1], got 0.0"


def test_each_option_named():
    """Each option is checked on its own, so the message names the one that is wrong."""
    assert message(THCConfig, saturation=1) == "thc: saturation must be True or False, got 1"
    assert message(THCConfig, saturation_rate=0.7) == "thc: saturation_rate must be a number in (0, 0.5], got 0.7"
    assert message(PowerSGDConfig, min_compression_rate="2") == (
        "powersgd: min_compression_rate must be a number >= 1, got '2'")
    assert message(PowerSGDConfig, uncompressed_dtype="bfloat16") == (
        "powersgd: uncompressed_dtype must be 'float16' or 'float32', got 'bfloat16'")
    assert message(TopKCConfig, payload_dtype="int8") == (
        "topkc: payload_dtype must be 'float16' or 'float32', got 'int8'")
