"""Byte-level language model on Python stdlib sources (PyTorch + Horovod), compressor as a spec.

    horovodrun -np 2 --gloo python -m hvd_gradcomp.bench.workers.lm_torch --compression fp16

Same loop, timing and output as :mod:`.digits_torch`; the model, corpus (a fixed list
of stdlib files, see :mod:`hvd_gradcomp.bench.data`) and metric (validation perplexity per
byte, lower is better) are described in :mod:`.torch_workloads`.
"""
import sys

from .digits_torch import main

if __name__ == "__main__":
    sys.exit(main(workload="lm"))
