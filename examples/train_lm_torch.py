"""Byte-level language model on Python stdlib sources (PyTorch + Horovod), compressor as a spec.

    horovodrun -np 2 --gloo python examples/train_lm_torch.py --compression fp16

Same loop, timing and output as ``train_digits_torch.py``; the model, corpus (a fixed list
of stdlib files, see :mod:`hvd_gradcomp.bench.data`) and metric (validation perplexity per
byte, lower is better) are described in ``torch_workloads``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_digits_torch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(workload="lm"))
