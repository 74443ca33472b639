"""Integer lanes (hvd_gradcomp/lanes.py): THC's layouts keep every sum of up to 1024 ranks'
words inside int32 and each lane exact, Average's truncated words come back exactly, and
docs/thc.md's table of wire bits is the layout's. The layout formulas used as the reference
(:func:`~tests.core.thc_emulation.np_lanes`) are in tests/core/thc_emulation.py.
"""
import os
import re

import numpy as np
import pytest

from hvd_gradcomp.lanes import MAX_WORLD_SIZE, exact_words, lane_layout, wire_bits
from tests.backends import as_numpy as _np, backend_ops
from tests.core.thc_emulation import np_lanes


def test_lanes_never_carry_up_to_max_world_size():
    """Every (bits, lane_bits, n, op) the layout accepts keeps any sum of the words of c <= n
    ranks inside int32 (each rank took the offset K off), and each lane of the sum, K added back
    c times, is exactly the ranks' levels summed; the layout is the one np_lanes derives.

    The worst cases at every world size up to MAX_WORLD_SIZE (1024), on Python ints: all c
    ranks at the top level L in every lane, and all at level 0. The same for the statistics
    lanes (codes up to 1023) and the control words (the fingerprint's s**2 below 2**(2h)).
    """
    for bits, lane_bits, op in [(b, lb, op) for b in (1, 2, 4, 8, 16) for lb in (None, 2, 8, 16)
                                for op in ("sum", "average")]:
        for n in range(1, MAX_WORLD_SIZE + 1):
            try:
                want = np_lanes(bits, n, lane_bits, op)
            except ValueError:
                assert lane_bits is None
                with pytest.raises(ValueError, match="thc: "):
                    lane_layout(bits, n, lane_bits, op)
                continue
            lay = lane_layout(bits, n, lane_bits, op)
            top, guard, width, lanes, k = want
            assert (lay.top, lay.guard, lay.width, lay.lanes, lay.offset) == want
            assert (op == "sum" or 2 ** guard > n) and n * top < 2 ** width and guard + lanes * width <= 32
            assert top == (1 << bits) - 1 if lane_bits is None else 1 <= top < 2 ** bits
            word = sum(top << (guard + j * width) for j in range(lanes))
            for c in (1, n):
                total = c * (word - k)  # the Sum all-reduce of c identical words
                assert -2 ** 31 <= -c * k and total < 2 ** 31 and total % (1 << guard) == 0
                assert all(((total + c * k) >> (guard + j * width)) & ((1 << width) - 1) == c * top
                           for j in range(lanes))
    with pytest.raises(ValueError, match="world size"):
        lane_layout(4, MAX_WORLD_SIZE + 1)


def test_subtract_own_lanes_recover_the_others_sum():
    """``subtract_own``: lanes for the other ranks' levels only. For every (bits, lane_bits, op)
    and world size up to 1024 the layout is np_lanes's, a lane holds the sum of n - 1 ranks
    at the top level, and from the int32 sum of all n ranks' words (wrapped modulo 2**32, the
    int32 Sum's two's complement) a rank recovers the others' lanes by others_words; the
    layout never holds fewer levels in as many lanes as the summing layout's (at lane_bits=8
    from 64 ranks on it may trade levels for a lane, as that option's rule says)."""
    from hvd_gradcomp.lanes import others_words
    ops = backend_ops("torch")
    import torch
    for bits, lane_bits, op in [(b, lb, op) for b in (1, 2, 4, 8) for lb in (None, 8, 16) for op in ("sum", "average")]:
        for n in range(1, MAX_WORLD_SIZE + 1):
            lay = lane_layout(bits, n, lane_bits, op, subtract_own=True)
            top, guard, width, lanes, k = np_lanes(bits, n, lane_bits, op, own=True)
            assert (lay.top, lay.guard, lay.width, lay.lanes, lay.offset, lay.others) == (top, guard, width, lanes, 0,
                                                                                         True)
            assert max(1, n - 1) * top < 2 ** width and guard + lanes * width <= 32
            try:
                plain = lane_layout(bits, n, lane_bits, op)
            except ValueError:
                continue
            assert (top >= plain.top and lanes >= plain.lanes) or lanes > plain.lanes
    gen = np.random.default_rng(0)
    for n, op in ((2, "sum"), (2, "average"), (3, "sum"), (5, "average")):
        lay = lane_layout(4, n, 8, op, subtract_own=True)
        levels = gen.integers(0, lay.top + 1, (n, lay.lanes, 64))
        levels[:, :, 0] = lay.top  # every rank at the top in every lane
        words = np.array([sum(levels[r, j].astype(np.int64) << (lay.guard + j * lay.width) for j in range(lay.lanes))
                          for r in range(n)])
        total = (words.sum(0) + 2 ** 31) % 2 ** 32 - 2 ** 31  # the int32 Sum, wrapped
        own = (words[0] + 2 ** 31) % 2 ** 32 - 2 ** 31  # rank 0's words as int32
        got = _np(others_words(ops, torch.from_numpy(total), torch.from_numpy(own).to(torch.int32)))
        want = levels[1:].sum(0)
        for j in range(lay.lanes):
            np.testing.assert_array_equal((got >> (lay.guard + j * lay.width)) & ((1 << lay.width) - 1), want[j])


def test_docs_table_matches_layout():
    """docs/thc.md's table of wire bits (the one thc.py's docstring points to) is the layout's."""
    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "thc.md")).read()
    rows = re.findall(r"^\|\s*(\d+|none)\s*\|\s*(sum|average)\s*((?:\|\s*[\d.]+ \(\d+\)\s*){5})\|\s*$", doc, re.M)
    assert [(r[0], r[1]) for r in rows] == [(b, op) for b in ("8", "none") for op in ("sum", "average")]
    for lane_bits, op, cells in rows:
        lane_bits = None if lane_bits == "none" else int(lane_bits)
        for n, (value, top) in zip((2, 8, 16, 64, 128), re.findall(r"([\d.]+) \((\d+)\)", cells)):
            assert int(top) == lane_layout(4, n, lane_bits, op).top == np_lanes(4, n, lane_bits, op)[0]
            assert float(value) == round(wire_bits(4, n, lane_bits, op), 2)


@pytest.mark.parametrize("n", [2, 3, 5, 7, 12, 16, 100, 999, 1000, 1024])
def test_average_recovers_exact_words(n):
    """Step 6: from Horovod's truncated average, the exact sum W comes back, for every W.

    W is a multiple of 2**g (the guard bits) in int32's range, negative ones included.
    Averages are emulated as trunc(W * (1/n)) in double (Horovod's scale; NCCL's integer
    division truncates too) and, for W >= 0, as floor(W / n); ``summed`` given as a Python
    bool and as a bool tensor.
    """
    ops = backend_ops("torch")
    import torch
    guard = n.bit_length()
    rng = np.random.default_rng(n)
    top, bottom = (2 ** 31 - 1) >> guard, -(2 ** 31 >> guard)
    units = np.concatenate([np.arange(0, 5000), top - np.arange(0, 5000), rng.integers(bottom, top, 20000),
                            (np.arange(1, 5000) * n), -np.arange(0, 5000), bottom + np.arange(0, 5000),
                            -(np.arange(1, 5000) * n)])
    units = units[(units >= bottom) & (units <= top)]
    exact = units.astype(np.int64) << guard
    for average in (np.trunc(exact.astype(np.float64) * (1.0 / n)), np.where(exact >= 0, exact // n, -(-exact // n))):
        words = torch.as_tensor(average.astype(np.int64))
        for summed in (False, torch.tensor(False)):
            np.testing.assert_array_equal(_np(exact_words(ops, words, summed, n, guard)), exact)
    # ...and a sum is taken as it is.
    for summed in (True, torch.tensor(True)):
        np.testing.assert_array_equal(_np(exact_words(ops, torch.as_tensor(exact), summed, n, guard)), exact)
