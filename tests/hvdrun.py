"""Run a function on N real Horovod processes (Gloo on CPU) and collect each rank's result.

Each launch costs seconds (TensorFlow's import more), so tests group many checks into one
worker function and assert on its returned values. Workers must return picklable values
(Python numbers, lists, dicts, NumPy arrays).
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(fn, np=2, args=(), kwargs=None, env=None):
    """``horovod.run(fn, num_proc=np, use_gloo=True)`` from the repository root; returns [rank0, rank1, ...]."""
    import horovod
    saved = dict(os.environ)  # horovod.run passes the caller's environment to the workers
    try:
        os.environ["PYTHONPATH"] = ROOT + os.pathsep + saved.get("PYTHONPATH", "")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.update(env or {})
        return horovod.run(fn, args=args, kwargs=kwargs or {}, num_proc=np, use_gloo=True, verbose=0)
    finally:
        os.environ.clear()
        os.environ.update(saved)
