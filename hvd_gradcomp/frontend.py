"""What a codec needs of the framework its tensors live in: the :class:`Frontend`.

A :class:`~hvd_gradcomp.codec.Codec` is framework-free: the math goes through the primitives
table (``ops``), the scheme states through a :class:`~hvd_gradcomp.store.Store`, and the few
framework facts below through the frontend it is handed (``torch_backend.compression.TorchFrontend``,
``tf_backend.compression.TFFrontend``). The defaults here are the framework-free answers (no
autograd, static shapes, CPU, no sparse tensors), which the one-process tests use as they are.

Codec-facing:

- ``detach(tensor)``: the gradient without autograd history;
- ``static(tensor, call)``: the tensor with a fully known static shape (TensorFlow's
  ``sparse_as_dense`` gradients take their variable's), else ValueError naming it;
- ``scale_of(source)``: a loss-scale source's current scale, a 0-d float32 device tensor;
- ``on_gpu(tensor)``: whether the collective will run on a GPU (Horovod's NCCL Average);
- ``is_sparse(tensor)``: a sparse gradient (refused by ``encode``);
- ``build_state(build, like)``: ``build(like)`` where a first state must be made
  (TensorFlow: outside any graph, with ``like`` None);
- ``route_items(params)``: ``(name, shape, dtype, pin)`` per parameter given to ``route()``;
- ``read_sparse(entry)``: ``(bytes last step, steps)`` of a sparse entry as ints;
- ``process_world()``: ``(size, rank)`` of the framework's own process group, or (None, None).

Horovod-facing (:class:`~hvd_gradcomp.adapter.HorovodCompressor` only): ``find_call(tensor)``
(the :class:`~hvd_gradcomp.calls.Call` read from Horovod's frames), ``horovod()`` (the
framework's Horovod module), ``no_key_message``, ``uncompressed(payload, compressor)`` (a
payload compress never saw: PyTorch counts sparse ones) and ``watch_sparse(call, compressor)``
(TensorFlow's ``IndexedSlices``). A frontend belongs to one compressor (TensorFlow's keeps the
last batch it watched).
"""
from .calls import Call

__all__ = ["Frontend"]


class Frontend:
    """The framework-free frontend (module docstring); backends subclass it."""

    no_key_message = "{scheme}: cannot tell which tensor this is; call compress(tensor, name=...)"

    def detach(self, tensor):
        return tensor

    def static(self, tensor, call):
        return tensor

    def scale_of(self, source):
        return source

    def on_gpu(self, tensor) -> bool:
        return False

    def is_sparse(self, tensor) -> bool:
        return False

    def build_state(self, build, like):
        return build(like)

    def route_items(self, params):
        for name, p in params:
            yield name, tuple(p.shape), str(p.dtype).removeprefix("torch."), None

    def read_sparse(self, entry):
        return int(entry[0]), int(entry[1])

    def process_world(self):
        return None, None

    # ---- Horovod-facing ----
    def find_call(self, tensor) -> Call:
        return Call()

    def horovod(self):
        raise ImportError("this frontend has no Horovod; bind an engine (codec.bind_engine)")

    def uncompressed(self, payload, compressor):
        """A payload ``decompress`` got that ``compress`` never saw; default: nothing."""

    def watch_sparse(self, call, compressor):
        """Note the sparse gradients of ``call.batch``; default: nothing."""
