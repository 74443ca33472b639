"""``--device`` for the PyTorch TTA workers and the harness: where models, data and all-reduces run.

``--device cpu`` (default) is what the harness always did: everything on the CPU, Horovod and
DDP over Gloo. ``--device cuda``:

- each rank uses GPU ``rank % torch.cuda.device_count()`` (all ranks run on one host; NCCL
  refuses two ranks of one communicator on the same GPU, so ``--workers`` may not exceed the
  GPU count: refused before anything starts);
- model and the workload's tensors move to it (:func:`place_workload`), batches are indexed
  there;
- Horovod all-reduces CUDA tensors with NCCL (its build must have NCCL: ``make setup`` on a
  CUDA machine, docs/gpu.md; refused otherwise), DDP rows use the ``nccl`` process group;
- the step split is read from synchronised clocks (:func:`clock`: the compute stream is
  drained before each reading, so asynchronous kernels count where they ran, not where they
  were launched; Horovod's and DDP's NCCL kernels run on streams of their own and are not
  waited for there), and the compressor proxy synchronises around each compress/decompress;
- on an emulated (rate-limited) network, NCCL is kept off its peer-to-peer and shared-memory
  transports (:func:`launch_env`), so its traffic takes the sockets of the namespaces' veth
  links and the rate limit applies; on ``--loopback`` NCCL picks its own (fastest) path.

Where CUDA is absent, ``--device cuda`` is refused with a message saying why
(:func:`check_device`, :class:`DeviceUnavailable`).
"""
import time

__all__ = ["DEVICES", "DeviceUnavailable", "add_device_arg", "check_device", "require_device", "check_sweep",
           "rank_device", "place_workload", "clock", "sync_fn", "launch_env"]

DEVICES = ("cpu", "cuda")


class DeviceUnavailable(ValueError):
    """``--device cuda`` asked for where it cannot run (the message says why)."""


def add_device_arg(parser):
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where models, data and all-reduces run: cpu (Gloo) or cuda "
                             "(NCCL; one GPU per rank on this host)")


def _cuda_count():
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(device, ranks=1, horovod=None):
    """Raise :class:`DeviceUnavailable` unless ``device`` can serve ``ranks`` ranks here.

    Args:
        device: "cpu" or "cuda".
        ranks: ranks that will share this host's GPUs (one GPU each).
        horovod: the initialised ``horovod.torch`` module for a Horovod worker (its build must
            have NCCL), or None.
    """
    if device not in DEVICES:
        raise DeviceUnavailable(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu":
        return
    import torch
    count = _cuda_count()
    if count == 0:
        raise DeviceUnavailable(
            f"--device cuda: PyTorch {torch.__version__} sees no CUDA device "
            f"(torch.cuda.is_available() is False{'; a CPU build' if torch.version.cuda is None else ''}); "
            f"run on a GPU machine set up by `make setup` (docs/gpu.md), or use --device cpu")
    if ranks > count:
        raise DeviceUnavailable(
            f"--device cuda: {ranks} ranks need {ranks} GPUs on this host (NCCL refuses two ranks "
            f"on one GPU), and PyTorch sees {count}; use --workers {count} or fewer")
    if horovod is not None and not horovod.nccl_built():
        raise DeviceUnavailable(
            "--device cuda: this Horovod was built without NCCL (hvd.nccl_built() == 0), so CUDA "
            "tensors would be copied to the host for Gloo; rebuild it with `make setup` on this "
            "machine (HOROVOD_GPU_OPERATIONS=NCCL, docs/gpu.md)")


def require_device(parser, device, horovod=None):
    """A worker's :func:`check_device`: ``parser.error`` with its message (exit status 2) when
    ``device`` cannot run here."""
    try:
        check_device(device, horovod=horovod)
    except DeviceUnavailable as e:
        parser.error(str(e))


def check_sweep(args, frameworks):
    """The harness' check of ``--device`` before anything starts (``frameworks``: the sweep's
    workloads' frameworks). Raises :class:`DeviceUnavailable`."""
    device = getattr(args, "device", "cpu")
    if device == "cpu":
        return
    if any(f != "torch" for f in frameworks):
        raise DeviceUnavailable("--device cuda: only the PyTorch workloads run on CUDA so far "
                                "(the TensorFlow worker places ops itself); drop the -tf workloads")
    check_device(device, args.workers)


def rank_device(device, rank):
    """The ``torch.device`` of ``rank``: the CPU, or GPU ``rank % device_count``."""
    import torch
    if device == "cpu":
        return torch.device("cpu")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def place_workload(workload, device):
    """Move every tensor attribute of a workload (training and test data) to ``device``;
    returns it. Index tensors built on the host per batch index device tensors directly."""
    import torch
    for name, value in list(vars(workload).items()):
        if isinstance(value, torch.Tensor):
            setattr(workload, name, value.to(device))
    return workload


def sync_fn(device):
    """A callable that waits for the work queued on ``device``'s current (compute) stream, or
    None on the CPU. Not the whole device: an all-reduce in flight on NCCL's stream is
    communication, and must not be waited for inside a compute or codec reading."""
    import torch
    if torch.device(device).type != "cuda":
        return None
    return lambda: torch.cuda.current_stream(device).synchronize()


def clock(device):
    """``() -> seconds`` (``time.perf_counter``) that first waits for the kernels queued on
    ``device``'s compute stream (:func:`sync_fn`), so a reading falls after the work launched
    before it."""
    sync = sync_fn(device)
    if sync is None:
        return time.perf_counter

    def synced():
        sync()
        return time.perf_counter()
    return synced


def launch_env(device, net):
    """Extra environment for every rank: on CUDA over an emulated (rate-limited) network,
    NCCL's socket transport on the namespace's interface (no P2P, shared memory or
    InfiniBand, which would bypass the veth links and their limit); nothing otherwise."""
    if device != "cuda" or getattr(net, "mode", "loopback") == "loopback":
        return {}
    return {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
            "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": net.iface}
