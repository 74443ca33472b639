"""``auto``: each tensor gets the candidate compressor that pays, from measured cost and error.

Every tensor starts on one agreed candidate; every ``every`` steps a window of ``warmup`` steps
runs the other candidates as shadows beside the real step, their codec ms and one-step error
ride to every rank in the payload's lanes, and one deterministic function picks, for each
tensor, the candidate of least predicted ``codec ms + all-reduce ms`` within the error budget,
unless the whole step would not be ``1 + step_penalty`` times faster than fp16 (the step gate).
A switch carries the pending error feedback; ranks that fall out of step (``hvd.join()``, a
state loaded on some ranks, an elastic worker) are realigned through the payload.

Modules, by job:
- :mod:`~hvd_gradcomp.auto.decisions`: the link model, the start and the decisions (pure: no
  framework, no tensors).
- :mod:`~hvd_gradcomp.auto.window`: the measurement window, its lanes and the sync step.
- :mod:`~hvd_gradcomp.auto.scheme`: :class:`AutoConfig` and :class:`AutoScheme`, the per-tensor
  lifecycle.

The method step by step, and the measurements behind each rule: docs/auto.md.
"""
from .decisions import (CALIBRATIONS, DEFAULT_CANDIDATES, FALLBACK, LANE_MAX, UNUSABLE, Decision, Link, decide,
                     start_choice)
from .scheme import OPTION_JOIN, AutoConfig, AutoScheme

__all__ = ["AutoConfig", "AutoScheme", "Link", "Decision", "decide", "start_choice", "OPTION_JOIN",
           "DEFAULT_CANDIDATES", "FALLBACK", "CALIBRATIONS", "LANE_MAX", "UNUSABLE"]
