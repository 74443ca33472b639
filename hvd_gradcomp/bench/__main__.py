"""``python -m hvd_gradcomp.bench <command> [options]``.

Commands:
    tta       time-to-accuracy sweep over a bandwidth-limited emulated network (the main job)
    overhead  compress + decompress cost per compressor and tensor size, against FP16
    codec     ops and codec time per step of the DDP hooks: a 147-tensor model against one flat tensor
    percall   codec time per step on Horovod's per-tensor path, warm and with the caches evicted
    model     scale model: projected step time and TTA ratio vs FP16 for N workers and links
    publish   a finished sweep's table and plots into a docs block, from its results.json
    autospeed auto against fixed fp16 on the link as it is: first window's cost, settled ratio
    scale     steps to FP16's target at 2-64 ranks, simulated in one process; TTA from the ring model
    staleness what one step of delay costs in steps (delayed hooks), simulated in one process

Each command's ``--help`` lists its options.
"""
import importlib
import sys

COMMANDS = {"tta": "hvd_gradcomp.bench.tta_sweep", "overhead": "hvd_gradcomp.bench.overhead",
            "codec": "hvd_gradcomp.bench.codec", "percall": "hvd_gradcomp.bench.percall",
            "model": "hvd_gradcomp.bench.model_projection", "publish": "hvd_gradcomp.bench.publish",
            "autospeed": "hvd_gradcomp.bench.autospeed", "scale": "hvd_gradcomp.bench.scale",
            "staleness": "hvd_gradcomp.bench.staleness"}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
