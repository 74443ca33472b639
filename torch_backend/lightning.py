"""hvd-gradcomp's compressors in PyTorch Lightning: a ``Callback`` that installs the DDP hook.

Usage::

    import lightning.pytorch as pl
    from torch_backend import Compression
    from torch_backend.lightning import CompressionCallback
    trainer = pl.Trainer(strategy="ddp", callbacks=[CompressionCallback(Compression.topkc(0.1))])
    trainer.fit(module)

Why a callback: Lightning 2.x registers ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)``
on CUDA only (``DDPStrategy._register_ddp_hooks``; on CPU the option is silently dropped;
where it is registered, :func:`torch_backend.ddp.comm_state` makes the state). The callback
calls :func:`torch_backend.ddp.register_comm_hook` in ``on_fit_start``, when the strategy has
wrapped the module in ``DistributedDataParallel`` and before the first backward, so gradients
are keyed and routed by the LightningModule's parameter names, on any device, and it carries
the compressor's state in Lightning's checkpoints.

Checkpoints: Lightning saves callbacks' ``state_dict()`` in its checkpoint (built on every
rank, written by rank 0); here that is ``compressor.state_dict(gather=True)`` (every rank's
error feedback, one ``all_gather_object``). ``trainer.fit(..., ckpt_path=...)`` hands it back
through ``load_state_dict`` before the model is wrapped; the callback loads it into the
compressor right after binding it in ``on_fit_start``: each rank resumes with its own state.

The class derives from ``lightning.pytorch.Callback`` (the ``lightning`` package), else from
``pytorch_lightning.Callback``: use the Trainer of the same package.

Raises (from ``on_fit_start``): TypeError when the strategy's model is not a
``DistributedDataParallel`` (e.g. ``strategy="fsdp"`` or a single device: use
:mod:`torch_backend.fsdp` for FSDP), and what :func:`~torch_backend.ddp.register_comm_hook`
raises (a compressor used by another model, blocking variants).
"""
try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone pytorch_lightning package
    from pytorch_lightning import Callback

from .ddp import register_comm_hook

__all__ = ["CompressionCallback"]


class CompressionCallback(Callback):
    """Registers ``compressor`` as the DDP communication hook of the Trainer's model.

    Args:
        compressor: a compressor from ``torch_backend.Compression`` (any spec, rules and
            ``auto`` included), used by no other model; one ``fit`` per callback.
    """

    def __init__(self, compressor):
        super().__init__()
        self.compressor = compressor
        self._pending = None  # a checkpoint's state, loaded once the compressor is bound

    def on_fit_start(self, trainer, pl_module):
        from torch.nn.parallel import DistributedDataParallel
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"CompressionCallback: the strategy {type(trainer.strategy).__name__} "
                            f"wraps the module in {type(model).__name__}, not "
                            f"DistributedDataParallel; use strategy='ddp' (for FSDP2: "
                            f"torch_backend.fsdp.install)")
        register_comm_hook(model, self.compressor)
        if self._pending is not None:
            self.compressor.load_state_dict(self._pending)
            self._pending = None

    def state_dict(self):
        if self.compressor.engine is None:  # not bound yet: nothing compressed, nothing to save
            return {}
        return {"compression": self.compressor.state_dict(gather=True)}

    def load_state_dict(self, state_dict):
        state = state_dict.get("compression")
        if state is None:
            return
        if self.compressor.engine is None:
            self._pending = state
        else:
            self.compressor.load_state_dict(state)
