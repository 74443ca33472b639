"""The communication-bound LM (``lm-comm``, issue 25), PyTorch + Horovod, compressor as a spec.

    horovodrun -np 2 --gloo python -m hvd_gradcomp.bench.workers.lm_comm_torch --compression fp16

The byte-level transformer of :mod:`.lm_torch`, narrower and trained for a fixed budget of
steps with no absolute target (the report measures every row against FP16's final
perplexity of the same sweep); it logs Adam's per-tensor statistics. Model, budget and
target rule: :class:`.torch_workloads.LMCommWorkload`; loop and output: :mod:`.digits_torch`.
"""
import sys

from .digits_torch import main

if __name__ == "__main__":
    sys.exit(main(workload="lm-comm"))
