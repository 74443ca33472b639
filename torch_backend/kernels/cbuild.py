"""Compile a C source of ``csrc/`` once per machine and load it with ``ctypes``.

Used by the CPU providers (:mod:`torch_backend.kernels.cpu_thc`,
:mod:`torch_backend.kernels.cpu_topkc`). Method:

1. The compiler is ``$CC`` (split like a shell word list, so ``CC="ccache gcc"`` works), else
   ``cc``. Flags: :data:`FLAGS` (``-O3 -march=native``, C99, ``-ffp-contract=off`` so that no
   multiply-add is fused, whose single rounding would differ from PyTorch's two, and no
   ``-ffast-math``: every float operation of the source is kept as written, in its order;
   ``-fno-math-errno -fno-trapping-math`` change no value, they only let the compiler
   vectorise ``floorf`` and ``sqrtf``). Without ``-march=native`` (a compiler that refuses it)
   the compiler's default target.
2. The library's folder is named by a SHA-256 of the source, the compiler command and flags,
   and what ``-march=native`` means on this machine (the compiler's predefined macros for
   those flags, ``cc -dM -E``, which name its version and the CPU features it targets): a
   shared home directory seen from different CPUs gets one library per kind of CPU.
3. Cache: ``$HVD_GRADCOMP_CACHE``, else ``$XDG_CACHE_HOME/hvd-gradcomp``, else
   ``~/.cache/hvd-gradcomp``; the library is ``kernels/<hash>/lib<name>.so``. It is compiled
   into a temporary file in that folder and renamed into place (atomic on POSIX), so ranks
   that compile at once each write their own temporary and the last rename wins with an
   identical file; a reader never sees a partial library.
4. Loaded with ``ctypes.CDLL``, whose calls release the GIL.

Failures (no compiler, a compile error, an unwritable cache) raise ``ImportError`` with the
reason, so that :mod:`torch_backend.kernels` keeps the reference and
:func:`torch_backend.kernels.status` reports why.
"""
import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile

__all__ = ["FLAGS", "cache_dir", "compiler", "load"]

FLAGS = ("-O3", "-march=native", "-std=c99", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
         "-fPIC", "-shared")
_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_LOADED = {}


def cache_dir() -> str:
    """The cache folder (module docstring, step 3)."""
    root = os.environ.get("HVD_GRADCOMP_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "hvd-gradcomp")
    return os.path.join(root, "kernels")


def compiler() -> list:
    """The compiler command: ``$CC`` split into words, else ``["cc"]``."""
    return shlex.split(os.environ.get("CC", "").strip() or "cc")


def _run(cmd, **kwargs):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ImportError(f"hvd_gradcomp: cannot run the C compiler {' '.join(cmd[:1])!r} "
                          f"({type(exc).__name__}: {exc}); set CC or install gcc") from exc


def _target(cc, flags) -> str:
    """The compiler's predefined macros for ``flags`` (its version and the target's features)."""
    return _macros(tuple(cc), tuple(f for f in flags if f.startswith("-m")))


@functools.lru_cache(maxsize=None)  # one probe per process for every library of the same flags
def _macros(cc, arch) -> str:
    cc, arch = list(cc), list(arch)
    res = _run(cc + arch + ["-dM", "-E", "-x", "c", os.devnull])
    if res.returncode != 0:
        raise ImportError(f"hvd_gradcomp: the C compiler {' '.join(cc)!r} failed (exit status "
                          f"{res.returncode}) printing its predefined macros for "
                          f"{' '.join(arch) or 'its default target'}: "
                          f"{res.stderr.strip()[-500:] or 'no message'}; set CC or install gcc")
    return res.stdout


def load(name: str, extra_flags=()):
    """``ctypes.CDLL`` of ``csrc/<name>.c`` compiled for this machine (module docstring).

    ``extra_flags`` go after :data:`FLAGS` (a later ``-march`` wins; the tests build other
    variants this way, e.g. ``-march=x86-64`` or ``-DHGC_SCALAR_WHT``, and compare them bit for
    bit); they are part of the library's hash.

    Raises:
        ImportError: no compiler, the compile failed, or the library cannot be written or loaded.
    """
    cc = compiler()
    key = (name, tuple(extra_flags), tuple(cc), cache_dir())
    if key in _LOADED:
        return _LOADED[key]
    with open(os.path.join(_CSRC, name + ".c"), "rb") as f:
        source = f.read()
    flags = list(FLAGS) + list(extra_flags)
    try:
        target = _target(cc, flags)
    except ImportError:
        # A compiler without -march=native (some non-x86 compilers): its default target.
        flags = [f for f in flags if f != "-march=native"]
        target = _target(cc, flags)
    digest = hashlib.sha256()
    for part in (source, " ".join(cc + flags).encode(), platform.machine().encode(), target.encode()):
        digest.update(part)
        digest.update(b"\0")
    folder = os.path.join(cache_dir(), digest.hexdigest()[:24])
    path = os.path.join(folder, f"lib{name}.so")
    if not os.path.exists(path):  # else built before, by this or another process
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".lib{name}.", suffix=".so.tmp", dir=folder)
            os.close(fd)
        except OSError as exc:
            raise ImportError(f"hvd_gradcomp: cannot write the kernel cache {folder} ({exc}); "
                              f"set HVD_GRADCOMP_CACHE to a writable folder") from exc
        try:
            res = _run(cc + flags + ["-o", tmp, os.path.join(_CSRC, name + ".c"), "-lm"])
            if res.returncode != 0:
                raise ImportError(f"hvd_gradcomp: compiling {name}.c with {' '.join(cc + flags)} failed: "
                                  f"{res.stderr.strip()[-1000:]}")
            # mkstemp made it 0600: readable by every user of a shared cache, as a build's output
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise ImportError(f"hvd_gradcomp: cannot load {path} ({exc})") from exc
    _LOADED[key] = lib
    return lib
