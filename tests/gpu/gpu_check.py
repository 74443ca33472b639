"""The GPU check (issue 35): run it on a machine with a CUDA GPU, network or not (docs/gpu.md).

    make gpu-check                     # or: python tests/gpu/gpu_check.py
    make gpu-check-dry                 # the same logic on a CPU machine (HVD_GRADCOMP_GPU_CHECK_DRY_RUN=1)

It uses the Python that runs it (``make gpu-check``: ``$PY``, else ``.venv/bin/python`` when
there is one, else ``python3``): no venv, pip or apt unless Horovod is to be built from a local
sdist. Designed for <= 9 minutes on one H200 (each step has its own timeout, below).

Environment:
    HVD_GRADCOMP_GPU_CHECK_OUT: the report folder (default ``runs/gpu-check``; emptied first),
        at most 8 files: summary.txt, env.txt, pytest.txt, overhead.csv, overhead.txt,
        horovod-build.log, horovod.txt, codec.txt.
    HVD_GRADCOMP_GPU_CHECK_DRY_RUN=1: no CUDA needed. Decisions are printed, the pytest step
        collects its selection without running it (every test id and parameter resolved), the
        overhead bench runs on the CPU at 2^10, the Horovod build prints its plan (its inputs
        checked) without building, the Horovod test runs as is (it skips without a GPU).
    HVD_GRADCOMP_HOROVOD_SDIST=path: build Horovod (torch only, Gloo and NCCL, no MPI, no
        TensorFlow) from this sdist in the background while the PyTorch steps run, into
        ``<out>/../gpu-check-horovod/site`` (the running Python is not changed), then run the
        1-rank Horovod NCCL test with it. PIP_FIND_LINKS: the folder of the wheels it needs
        (cffi and pycparser for its setup_requires; cloudpickle, psutil, pyyaml, packaging if
        missing); pip never reaches an index. HOROVOD_BUILD_CUDA_CC_LIST (default 90), the
        build's jobs MAKEFLAGS (default -j<cores/2>).
    HVD_GRADCOMP_GPU_CHECK_CODEC_ARGS: arguments of the optional many-tensor codec benchmark
        (``python -m hvd_gradcomp.bench codec``; default ``--device cuda --kernels both --steps 6
        --warmup 2``, ``--help``
        in a dry run), run only where that module exists; its failure is reported and leaves
        the exit status alone.

Steps, each one's status in summary.txt (exit 0: all ok or skipped with a reason; 1: a step
failed; 2: no CUDA outside a dry run):
    1. environment: GPU, PyTorch/CUDA, TensorFlow and Horovod (each absent one: skipped, why);
    2. the Horovod build, started in the background (only with HVD_GRADCOMP_HOROVOD_SDIST);
    3. PyTorch on CUDA (pytest, TensorFlow parameters skip without TensorFlow): the core device
       tests (round trips, no host sync on every scheme variant's steady step under
       ``torch.cuda.set_sync_debug_mode("error")``, the codec products under each way of turning
       TF32 on, deterministic mode, a CUDA-graph capture of each codec step replayed equal to
       eager), the compiled kernels (Triton), the ncclAvg emulation, and the DDP hook on CUDA
       (2 ranks over Gloo with CUDA tensors, 1 rank over NCCL);
    4. the overhead bench at 2^24 and 2^26 (CUDA events);
    5. optional: the many-tensor codec benchmark, where ``hvd_gradcomp.bench.codec`` exists;
    6. with Horovod: the 1-rank Horovod NCCL test (tests/parallel/test_gpu.py).
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # this checkout's hvd_gradcomp, not an installed one (step 5's look-up)
    sys.path.insert(0, ROOT)
MAX_FILES = 8
# Seconds per step; with the start-up, 3 + 4 + 5 + 6 stay under 9 minutes on one H200.
TIMEOUTS = {"pytest": 240, "overhead": 90, "codec": 150, "horovod_test": 70, "build_wait": 40}
# The GPU test selection (step 3); the compiled CPU twin is CI's, not the GPU check's.
PYTEST_FILES = ["tests/core/test_devices.py", "tests/core/test_primitives.py", "tests/core/test_triton_launches.py",
                "tests/core/test_nccl_average.py", "tests/parallel/test_ddp_devices.py"]
PYTEST_DESELECT = "not (test_compiled_kernels_match_uncompiled and cpu) and not test_fused_form_matches_per_step_forms"
OVERHEAD_SCHEMES = "fp16;topkc;thc;powersgd:rank=4;signsgd"
# Step 5's default arguments: on the GPU, with the reference kernels' rows beside the Triton
# forms' (fewer steps than its own default, to fit its timeout; two warm-up steps: DDP rebuilds
# its buckets after the first, and each Triton kernel compiles at its first call).
CODEC_ARGS = "--device cuda --kernels both --steps 6 --warmup 2"


class Check:
    """One run of the check: the report folder, the summary lines and each step's status."""

    def __init__(self, out, dry):
        self.out, self.dry = out, dry
        self.lines, self.failed = [], False
        self.start = time.monotonic()

    def say(self, text):
        line = f"[gpu-check {time.monotonic() - self.start:5.0f}s] {text}"
        print(line, flush=True)
        self.lines.append(line)

    def result(self, step, status, why="", optional=False):
        """``status``: ok, FAILED, skipped (with ``why``); an optional step's failure is
        reported and leaves the exit status alone."""
        if status == "FAILED":
            if optional:
                why = f"{why}; optional step: the exit status is unaffected"
            else:
                self.failed = True
        self.say(f"{step}: {status}{f' ({why})' if why else ''}")

    def path(self, name):
        return os.path.join(self.out, name)

    def run(self, step, argv, log, timeout, env=None, append=False):
        """``argv`` under ``timeout`` (its process group killed at the end), output into
        ``log`` (a report file); returns the exit status (124 on a timeout)."""
        self.say(f"{step}: {' '.join(argv)}")
        with open(self.path(log), "a" if append else "w") as f:
            f.write(f"$ {' '.join(argv)}\n")
            f.flush()
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                    env=env or child_env(), start_new_session=True)
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                f.write(f"\n[gpu-check] killed after {timeout} s\n")
                return 124

    def write_summary(self):
        with open(self.path("summary.txt"), "w") as f:
            f.write("\n".join(self.lines) + "\n")


def kill_group(proc):
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def child_env(extra_path=None):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", TF_CPP_MIN_LOG_LEVEL="2",
               CUBLAS_WORKSPACE_CONFIG=os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    paths = [p for p in (extra_path, ROOT, os.environ.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def probe(code, env=None):
    """(exit status, last line of output) of ``python -c code``."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=env or child_env(), timeout=120)
    text = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode, text[-1] if text else ""


# ---------------------------------------------------------------- step 1
# One child process reports each framework (one line each), in the children's environment.
FRAMEWORKS_PROBE = """
import json
found = {}
def line(name, fn):
    try:
        found[name] = fn()
    except Exception as exc:
        found[name] = f"{type(exc).__name__}: {exc}"
def torch_line():
    import torch
    cuda = torch.cuda.is_available()
    return (f"torch {torch.__version__} cuda {torch.version.cuda} available {cuda} gpus "
            f"{torch.cuda.device_count()} name {torch.cuda.get_device_name(0) if cuda else '-'}")
def tf_line():
    import tensorflow as tf
    return f"tensorflow {tf.__version__}"
def hvd_line():
    import horovod, horovod.torch as hvd
    return f"horovod {horovod.__version__} nccl_built {hvd.nccl_built()}"
line("torch", torch_line)
line("tensorflow", tf_line)
line("horovod", hvd_line)
print(json.dumps(found))
"""


def environment(check):
    """Step 1: what this machine has; returns {"cuda": bool, "horovod": reason or None, ...}."""
    facts = {}
    lines = [f"python {sys.version.split()[0]} ({sys.executable})", f"repository {ROOT}"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    lines.append(f"commit {commit or 'unknown (no git)'}")
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        lines.append("nvidia-smi: " + (q.stdout.strip() or q.stderr.strip()))
    else:
        lines.append("nvidia-smi: not on PATH")
    code, found = probe(FRAMEWORKS_PROBE)
    found = json.loads(found) if code == 0 else {"torch": f"the probe failed: {found}"}
    torch_line = found.get("torch", "")
    facts["torch"] = torch_line.startswith("torch ")
    facts["cuda"] = facts["torch"] and "available True" in torch_line
    lines.append(torch_line if facts["torch"] else f"torch: cannot be imported ({torch_line})")
    tf_line = found.get("tensorflow", "")
    facts["tensorflow"] = None if tf_line.startswith("tensorflow ") else f"TensorFlow cannot be imported ({tf_line})"
    lines.append(tf_line if facts["tensorflow"] is None else facts["tensorflow"] + ": its tests skip")
    hvd_line = found.get("horovod", "")
    facts["horovod"] = None if hvd_line.startswith("horovod ") else f"Horovod cannot be imported ({hvd_line})"
    facts["horovod_nccl"] = facts["horovod"] is None and "nccl_built 0" not in hvd_line
    lines.append(hvd_line if facts["horovod"] is None else facts["horovod"])
    with open(check.path("env.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    for line in lines:
        check.say("env: " + line)
    return facts


def test_tools(check, facts):
    """pytest and NumPy for steps 3 and 6: where this Python lacks them, their wheels are
    installed from PIP_FIND_LINKS (no index) into a folder beside the report, put first on the
    children's PYTHONPATH. Returns None, or why the tests cannot run."""
    missing = [m for m in ("pytest", "numpy") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    links = os.environ.get("PIP_FIND_LINKS", "")
    if check.dry or not links:
        return (f"{', '.join(missing)} missing from this Python"
                + ("" if links else "; put its wheels (pytest: pluggy, iniconfig, packaging too) in a "
                   "folder named by PIP_FIND_LINKS"))
    target = os.path.join(os.path.dirname(os.path.abspath(check.out)), "gpu-check-tools")
    argv = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-index",
            "--find-links", links, "--target", target] + missing
    code = check.run("1. test tools", argv, "env.txt", 120, append=True)
    if code != 0:
        return f"installing {missing} from PIP_FIND_LINKS={links} failed (env.txt)"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (target, os.environ.get("PYTHONPATH")) if p)
    return None


# ---------------------------------------------------------------- step 2
def nccl_files():
    """(folder holding nccl.h, folder holding libnccl.so.2) of the nvidia NCCL wheel, or Nones."""
    try:
        import nvidia
    except ImportError:
        return None, None
    include = lib = None
    for base in list(getattr(nvidia, "__path__", [])):
        for dirpath, _, files in os.walk(base):
            if "nccl.h" in files and include is None:
                include = dirpath
            if "libnccl.so.2" in files and lib is None:
                lib = dirpath
    return include, lib


def libcuda():
    """The path of libcuda.so.1 (the driver), from ldconfig, or None."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.strip().startswith("libcuda.so.1 ") and "=>" in line:
            return line.split("=>")[1].strip()
    return None


def build_plan(check, sdist):
    """The Horovod build's inputs: ``(plan dict, problems list)``. Torch only, Gloo and NCCL,
    no MPI, no TensorFlow, installed with ``pip --target`` into a folder beside the report."""
    problems = []
    if not os.path.isfile(sdist):
        problems.append(f"HVD_GRADCOMP_HOROVOD_SDIST={sdist}: no such file")
    links = os.environ.get("PIP_FIND_LINKS", "")
    if not links or not os.path.isdir(links):
        problems.append(f"PIP_FIND_LINKS={links!r}: not a folder (it holds cffi/pycparser wheels)")
    nvcc = shutil.which("nvcc") or next((os.path.join(d, "bin", "nvcc") for d in
                                         (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda")
                                         if d and os.access(os.path.join(d, "bin", "nvcc"), os.X_OK)), None)
    if not nvcc:
        problems.append("no nvcc (PATH, $CUDA_HOME, /usr/local/cuda)")
    include, lib = nccl_files()
    if os.environ.get("HOROVOD_NCCL_HOME"):
        include = lib = None
    elif not (include and lib):
        problems.append("no NCCL: neither HOROVOD_NCCL_HOME nor the nvidia-nccl wheel's nccl.h and libnccl.so.2")
    cmake = shutil.which("cmake")
    if not cmake:
        problems.append("no cmake on PATH")
    work = os.path.join(os.path.dirname(os.path.abspath(check.out)), "gpu-check-horovod")
    nccl_home = os.environ.get("HOROVOD_NCCL_HOME") or os.path.join(work, "nccl")
    jobs = max(1, (os.cpu_count() or 2) // 2)
    env = {
        "HOROVOD_WITH_PYTORCH": "1", "HOROVOD_WITHOUT_TENSORFLOW": "1", "HOROVOD_WITHOUT_MXNET": "1",
        "HOROVOD_WITHOUT_MPI": "1", "HOROVOD_WITH_GLOO": "1",
        "HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_NCCL_LINK": "SHARED", "HOROVOD_NCCL_HOME": nccl_home,
        "HOROVOD_CUDA_HOME": os.path.dirname(os.path.dirname(nvcc)) if nvcc else "",
        "HOROVOD_BUILD_CUDA_CC_LIST": os.environ.get("HOROVOD_BUILD_CUDA_CC_LIST", "90"),
        # CMake 4 refuses Gloo's cmake_minimum_required(2.8.12) without it.
        "CMAKE_POLICY_VERSION_MINIMUM": "3.5",
        # Horovod 0.28.1 compiles as C++14, PyTorch's headers need C++17 (.ci/cmake-cxx17).
        "HOROVOD_CMAKE": os.path.join(ROOT, ".ci", "cmake-cxx17"), "HVD_GRADCOMP_REAL_CMAKE": cmake or "cmake",
        "MAKEFLAGS": os.environ.get("MAKEFLAGS", f"-j{jobs}"),
        "LDFLAGS": f"-Wl,-rpath,{nccl_home}/lib",
        "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": links,
    }
    site = os.path.join(work, "site")
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-index",
           "--find-links", links or ".", "--no-cache-dir", "--target", site]
    return {"env": env, "work": work, "site": site, "nccl": (include, lib), "sdist": sdist,
            # setup_requires (cffi) into the build's own folder, then Horovod itself with the
            # running Python's setuptools and PyTorch (no build isolation: it must see torch).
            "tools": pip + build_tools_missing() if build_tools_missing() else None,
            "build": pip + ["--no-build-isolation", "--no-deps", sdist],
            "deps": [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-index",
                     "--find-links", links or ".", "--target", site]}, problems


def build_tools_missing():
    """What the build needs that this Python lacks: cffi and pycparser (Horovod's
    setup_requires), setuptools, and wheel where setuptools is older than 70.1."""
    missing = [m for m in ("cffi", "pycparser", "setuptools") if importlib.util.find_spec(m) is None]
    if "setuptools" not in missing and importlib.util.find_spec("wheel") is None:
        try:
            from importlib.metadata import version
            major, minor = (int(v) for v in version("setuptools").split(".")[:2])
            if (major, minor) < (70, 1):
                missing.append("wheel")
        except (ImportError, ValueError):
            missing.append("wheel")
    return missing


def prepare_links(plan):
    """The libnccl.so link CMake wants (the wheel ships libnccl.so.2 only), and a libcuda.so
    link (Horovod dlopens the unversioned name) in the same folder, on LD_LIBRARY_PATH."""
    include, lib = plan["nccl"]
    home = plan["env"]["HOROVOD_NCCL_HOME"]
    if include and lib:
        os.makedirs(os.path.join(home, "lib"), exist_ok=True)
        target = os.path.join(home, "include")
        if not os.path.lexists(target):
            os.symlink(include, target)
        for name in ("libnccl.so.2", "libnccl.so"):
            link = os.path.join(home, "lib", name)
            if not os.path.lexists(link):
                os.symlink(os.path.join(lib, "libnccl.so.2"), link)
    driver = libcuda()
    if driver:
        os.makedirs(os.path.join(home, "lib"), exist_ok=True)
        link = os.path.join(home, "lib", "libcuda.so")
        if not os.path.lexists(link):
            os.symlink(driver, link)


class Build(threading.Thread):
    """Step 2 in the background: tools, Horovod, its missing run-time dependencies."""

    def __init__(self, check, plan):
        super().__init__(daemon=True)
        self.check, self.plan, self.status, self.why = check, plan, None, ""
        self.proc = None

    def run(self):
        plan, log = self.plan, self.check.path("horovod-build.log")
        env = dict(child_env(), **plan["env"])
        os.makedirs(plan["site"], exist_ok=True)
        with open(log, "w") as f:
            for name, argv in (("tools", plan["tools"]), ("horovod", plan["build"])):
                if argv is None:
                    continue
                f.write(f"$ {' '.join(argv)}\n")
                f.flush()
                self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                             env=dict(env, PYTHONPATH=os.pathsep.join([plan["site"], env["PYTHONPATH"]])),
                                             start_new_session=True)
                if self.proc.wait() != 0:
                    self.status, self.why = "FAILED", f"{name} step exit {self.proc.returncode}, see horovod-build.log"
                    return
            missing = [m for m, mod in (("cloudpickle", "cloudpickle"), ("psutil", "psutil"),
                                        ("pyyaml", "yaml"), ("packaging", "packaging"))
                       if importlib.util.find_spec(mod) is None]
            if missing:
                f.write(f"$ {' '.join(plan['deps'] + missing)}\n")
                f.flush()
                if subprocess.call(plan["deps"] + missing, stdout=f, stderr=subprocess.STDOUT, env=env) != 0:
                    self.status, self.why = "FAILED", f"missing run-time dependencies {missing} not in PIP_FIND_LINKS"
                    return
        self.status = "ok"

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc)


def start_build(check, facts):
    """Step 2: the background build, or why there is none. Returns a Build or None."""
    sdist = os.environ.get("HVD_GRADCOMP_HOROVOD_SDIST")
    if not sdist:
        check.result("2. horovod build", "skipped", "HVD_GRADCOMP_HOROVOD_SDIST not set"
                     + ("" if facts["horovod"] is None else "; " + facts["horovod"]))
        return None
    if facts["horovod"] is None and facts["horovod_nccl"]:
        check.result("2. horovod build", "skipped", "Horovod with NCCL already imports here")
        return None
    plan, problems = build_plan(check, sdist)
    for key in sorted(plan["env"]):
        check.say(f"2. horovod build env: {key}={plan['env'][key]}")
    if plan["tools"]:
        check.say("2. horovod build: " + " ".join(plan["tools"]))
    check.say("2. horovod build: " + " ".join(plan["build"]))
    if check.dry:
        check.result("2. horovod build", "skipped", "dry run: plan printed, nothing built"
                     + (f"; on this machine it would stop at: {'; '.join(problems)}" if problems else ""))
        return None
    if problems:
        check.result("2. horovod build", "FAILED", "; ".join(problems))
        return None
    prepare_links(plan)
    build = Build(check, plan)
    build.start()
    check.say("2. horovod build: started in the background (log: horovod-build.log)")
    return build


# ---------------------------------------------------------------- steps 3-6
def pytest_summary(check, log):
    """The last non-empty line of a pytest log in the report (its counts), and its skips."""
    with open(check.path(log)) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    skips = [line for line in lines if line.startswith("SKIPPED")]
    return (lines[-1] if lines else "") + (f"; {len(skips)} skip reasons in {log}" if skips else "")


def pytest_step(check, facts):
    if facts["no_tests"]:
        check.result("3. pytest", "FAILED", facts["no_tests"])
        return
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--tb=short",
            "--durations=10"] + PYTEST_FILES + ["-k", PYTEST_DESELECT]
    if check.dry:
        argv.append("--collect-only")
    code = check.run("3. pytest", argv, "pytest.txt", TIMEOUTS["pytest"])
    why = pytest_summary(check, "pytest.txt")
    if check.dry:
        why = "dry run: collected, not run; " + why
    check.result("3. pytest", "ok" if code == 0 else "FAILED", why)


def overhead_step(check):
    tmp = os.path.join(os.path.dirname(os.path.abspath(check.out)), "gpu-check-overhead")
    shutil.rmtree(tmp, ignore_errors=True)
    if check.dry:
        sizes = ["--devices", "cpu", "--min-log2", "10", "--max-log2", "10", "--reps", "2", "--min-reps", "2",
                 "--warmup", "1", "--budget", "0", "--copy-mib", "8"]
    else:
        sizes = ["--devices", "gpu", "--min-log2", "24", "--max-log2", "26", "--step", "2", "--reps", "20",
                 "--budget", "3"]
    argv = [sys.executable, "-m", "hvd_gradcomp.bench", "overhead", "--frameworks", "torch", "--layers", "none",
            "--schemes", OVERHEAD_SCHEMES, "--compile", "off", "--ddp-hooks", "off", "--out", tmp] + sizes
    code = check.run("4. overhead", argv, "overhead.txt", TIMEOUTS["overhead"])
    for name in ("overhead.csv", "overhead.txt"):
        src = os.path.join(tmp, name)
        if os.path.exists(src):
            if name == "overhead.txt":
                with open(src) as s, open(check.path(name), "a") as d:
                    d.write("\n" + s.read())
            else:
                shutil.copy(src, check.path(name))
    shutil.rmtree(tmp, ignore_errors=True)
    check.result("4. overhead", "ok" if code == 0 else "FAILED",
                 ("dry run: CPU at 2^10" if check.dry else "GPU at 2^24, 2^26") + "; overhead.csv")


def codec_step(check):
    """Step 5 (optional): the many-tensor codec benchmark, where the module exists."""
    if importlib.util.find_spec("hvd_gradcomp.bench.codec") is None:
        check.result("5. codec bench (optional)", "skipped", "hvd_gradcomp.bench.codec does not exist yet")
        return
    args = os.environ.get("HVD_GRADCOMP_GPU_CHECK_CODEC_ARGS", "--help" if check.dry else CODEC_ARGS).split()
    code = check.run("5. codec bench (optional)", [sys.executable, "-m", "hvd_gradcomp.bench", "codec"] + args,
                     "codec.txt", TIMEOUTS["codec"])
    check.result("5. codec bench (optional)", "ok" if code == 0 else "FAILED", "codec.txt", optional=True)


def horovod_step(check, facts, build):
    extra = None
    if build is not None:
        build.join(timeout=TIMEOUTS["build_wait"])
        if build.is_alive():
            build.stop()
            build.join()
            check.result("6. horovod test", "FAILED", "the build was not done in time; see horovod-build.log")
            return
        check.result("2. horovod build", build.status, build.why)
        if build.status != "ok":
            check.result("6. horovod test", "skipped", "the Horovod build failed")
            return
        extra = build.plan["site"]
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (os.path.join(build.plan["env"]["HOROVOD_NCCL_HOME"], "lib"), os.environ.get("LD_LIBRARY_PATH")) if p)
    elif facts["horovod"] is not None:
        check.result("6. horovod test", "skipped", facts["horovod"])
        return
    if facts["no_tests"]:
        check.result("6. horovod test", "FAILED", facts["no_tests"])
        return
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests/parallel/test_gpu.py"]
    env = child_env(extra)
    code = check.run("6. horovod test", argv, "horovod.txt", TIMEOUTS["horovod_test"], env=env)
    check.result("6. horovod test", "ok" if code == 0 else "FAILED", pytest_summary(check, "horovod.txt"))


def main():
    dry = os.environ.get("HVD_GRADCOMP_GPU_CHECK_DRY_RUN", "0") == "1"
    out = os.environ.get("HVD_GRADCOMP_GPU_CHECK_OUT", os.path.join(ROOT, "runs", "gpu-check"))
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    check = Check(out, dry)
    check.say(f"{'dry run' if dry else 'GPU check'}: report in {out}")
    facts = environment(check)
    if not facts["cuda"] and not dry:
        check.result("1. environment", "FAILED", "PyTorch sees no CUDA device: nothing to check here "
                                                "(HVD_GRADCOMP_GPU_CHECK_DRY_RUN=1 runs the logic without one)")
        check.write_summary()
        return 2
    facts["no_tests"] = test_tools(check, facts)
    check.result("1. environment", "ok", "CUDA" if facts["cuda"] else "no CUDA: dry run")
    build = start_build(check, facts)
    try:
        pytest_step(check, facts)
        overhead_step(check)
        codec_step(check)
        horovod_step(check, facts, build)
    finally:
        if build is not None:
            build.stop()
    files = sorted(os.listdir(out))
    files = sorted(set(files) | {"summary.txt"})
    check.say(f"report: {len(files)} files in {out}: {', '.join(files)}")
    check.say("exit " + ("1 (a step failed)" if check.failed else "0"))
    check.write_summary()
    assert len(os.listdir(out)) <= MAX_FILES, os.listdir(out)
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
