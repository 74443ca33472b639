"""The time-to-accuracy workers: one training run per launch, run as modules on every rank.

The harness (:mod:`hvd_gradcomp.bench.tta_sweep`) starts each of them with
``python -m hvd_gradcomp.bench.workers.<name> ...`` on every rank, never by file path, so an
installed package (``pip install .[bench]``) runs ``python -m hvd_gradcomp.bench tta`` as
well as a source checkout does. Each is also an ordinary Horovod program::

    horovodrun -np 2 --gloo python -m hvd_gradcomp.bench.workers.digits_torch --compression topkc:0.1

- :mod:`.digits_torch`: the digits MLP, PyTorch + ``hvd.DistributedOptimizer``.
- :mod:`.lm_torch`: the byte-level language model, same loop.
- :mod:`.digits_tf`: the digits MLP in Keras 2 + ``hvd.DistributedGradientTape``.
- :mod:`.ddp_torch`: the PyTorch workloads under ``torch.distributed`` DDP with its own hooks.
- :mod:`.fsdp_torch`: the LM workloads under FSDP2 as HSDP, FSDP's collectives native
  (FP16-FSDP) or compressed (``torch_backend.fsdp``).
- :mod:`.torch_workloads`: the PyTorch models, data shards and loop the PyTorch workers share.

Flags, timing and the JSON they write: :mod:`hvd_gradcomp.bench.worker`. Short examples for
users of the compressors are in the repository's ``examples/``, not here.
"""
