"""The package as installed, not as checked out: what the wheel holds, and that the harness
runs from it.

1. The wheel built from ``setup.py`` holds the harness's TTA workers
   (``hvd_gradcomp/bench/workers/*.py``) and its data file (the scale model's inputs), the two
   backends' stats helpers, ``torch_backend.kernels`` with its C sources, and nothing of
   ``examples/`` or ``tests/``.
2. Unpacked into a folder outside the checkout and run from another working directory, the
   harness's commands and a worker import from that folder (``python -m``, no file paths):
   ``python -m hvd_gradcomp.bench tta --help`` and ``python -m
   hvd_gradcomp.bench.workers.digits_torch --help``.
3. The core (``hvd_gradcomp/*.py`` outside ``bench/``) never imports the harness, nor a
   framework or NumPy, and every public module lists ``__all__``.
4. The DDP/FSDP path without Horovod (the ``ddp`` extra: PyTorch only): the wheel's metadata
   says so, the PyTorch modules import without importing Horovod, and
   ``examples/ddp_digits.py`` trains under ``torchrun`` with ``import horovod`` made to fail
   in every process (a ``sitecustomize`` that blocks it).
"""
import ast
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # A copy of what setup.py packages, so the build's build/ and egg-info stay out of the
    # checkout; --no-build-isolation: offline, with the setuptools already installed.
    src = out / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("hvd_gradcomp", "torch_backend", "tf_backend", "examples", "tests"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
                         capture_output=True, text=True, timeout=300, cwd=str(out))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (path,) = [p for p in out.iterdir() if p.suffix == ".whl"]
    return path


def test_wheel_holds_workers_and_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("__init__", "digits_torch", "digits_tf", "lm_torch", "ddp_torch", "fsdp_torch", "torch_workloads"):
        assert f"hvd_gradcomp/bench/workers/{module}.py" in names, module
    for path in ("hvd_gradcomp/bench/model_inputs_resnet50.json", "hvd_gradcomp/bench/model_shapes_resnet50.json",
                 "hvd_gradcomp/bench/linkcheck.py", "hvd_gradcomp/bench/launch.py", "hvd_gradcomp/bench/publish.py",
                 "hvd_gradcomp/stats.py", "torch_backend/stats.py", "tf_backend/stats.py",
                 # the fused kernels' registry, the CPU providers and the C they compile on first use
                 "torch_backend/kernels/__init__.py", "torch_backend/kernels/cbuild.py",
                 "torch_backend/kernels/cpu_thc.py", "torch_backend/kernels/csrc/thc.c",
                 "torch_backend/kernels/csrc/topkc.c", "torch_backend/kernels/cpu_powersgd.py",
                 "torch_backend/kernels/csrc/powersgd.c"):
        assert path in names, path
    assert not any(n.startswith(("examples/", "tests/")) for n in names)


def test_installed_package_runs_the_harness_as_modules(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), TF_CPP_MIN_LOG_LEVEL="2")
    where = subprocess.run([sys.executable, "-c", "import hvd_gradcomp.bench.workers as w, torch_backend as t; "
                            "print(w.__file__); print(t.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout
    res = subprocess.run([sys.executable, "-m", "hvd_gradcomp.bench", "tta", "--help"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--workloads" in res.stdout, res.stderr[-2000:]
    res = subprocess.run([sys.executable, "-m", "hvd_gradcomp.bench.workers.digits_torch", "--help"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--compression" in res.stdout and "--hidden" in res.stdout, res.stderr[-2000:]


def test_core_never_imports_the_harness():
    code = ("import sys, pkgutil, importlib, hvd_gradcomp;"
            "[importlib.import_module('hvd_gradcomp.' + m.name) for m in pkgutil.iter_modules(hvd_gradcomp.__path__)"
            " if m.name != 'bench'];"
            "print(sorted(m for m in sys.modules if m.startswith('hvd_gradcomp.bench')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    # Also imports inside functions, which the import above does not run.
    for name in sorted(os.listdir(os.path.join(ROOT, "hvd_gradcomp"))):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(ROOT, "hvd_gradcomp", name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = "hvd_gradcomp." * (node.level > 0) + (node.module or "")
                targets = [base] + [f"{base}.{a.name}".replace("..", ".") for a in node.names]
            else:
                continue
            assert not any(t.startswith("hvd_gradcomp.bench") for t in targets), (name, node.lineno)


def test_core_imports_no_framework():
    code = ("import sys, hvd_gradcomp, hvd_gradcomp.registry, hvd_gradcomp.adapter, hvd_gradcomp.rng;"
            "import pkgutil, importlib;"
            "[importlib.import_module('hvd_gradcomp.' + m.name) for m in pkgutil.iter_modules(hvd_gradcomp.__path__)"
            " if m.name != 'bench'];"
            "print(sorted(m for m in ('torch', 'tensorflow', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_public_module_lists_all():
    import importlib
    import pkgutil

    import hvd_gradcomp
    for m in pkgutil.iter_modules(hvd_gradcomp.__path__):
        if m.name in ("bench",):
            continue
        mod = importlib.import_module(f"hvd_gradcomp.{m.name}")
        assert hasattr(mod, "__all__"), m.name


def test_no_racy_temporary_names():
    """``tempfile.mktemp`` hands out a name another process may take first (Python's docs
    deprecate it); the package and its harness use ``mkdtemp``/``mkstemp`` instead."""
    for folder in ("hvd_gradcomp", "torch_backend", "tf_backend"):
        for here, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(here, name)
                with open(path) as f:
                    tree = ast.parse(f.read())
                calls = [node.lineno for node in ast.walk(tree)
                         if isinstance(node, ast.Attribute) and node.attr == "mktemp"
                         or isinstance(node, ast.alias) and node.name == "mktemp"]
                assert not calls, (os.path.relpath(path, ROOT), calls)


def test_wheel_extras(wheel):
    """pyproject.toml's metadata reaches the wheel; the ddp extra needs PyTorch, not Horovod."""
    (meta,) = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA")]
    lines = zipfile.ZipFile(wheel).read(meta).decode().splitlines()
    assert "Name: hvd-gradcomp" in lines and "Requires-Python: >=3.9" in lines
    extras = {line.split(": ", 1)[1] for line in lines if line.startswith("Provides-Extra: ")}
    assert {"ddp", "torch", "tf", "tf-cpu", "bench", "dev", "trainers"} <= extras, extras
    ddp = [line for line in lines if line.startswith("Requires-Dist: ") and "extra == 'ddp'" in line]
    assert ddp and all("torch" in line for line in ddp) and not any("horovod" in line for line in ddp), ddp


_BLOCK_HOROVOD = """import sys
sys.modules["horovod"] = None  # every "import horovod..." raises ImportError
"""


def test_ddp_path_without_horovod(tmp_path):
    code = ("import sys, torch_backend, torch_backend.ddp, torch_backend.engine, torch_backend.fsdp,"
            " torch_backend.lightning, torch_backend.stats;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'horovod'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
    from tests.ddprun import _free_port, launch_command
    from tests.test_examples import ACCURACY
    (tmp_path / "sitecustomize.py").write_text(_BLOCK_HOROVOD)
    check = subprocess.run([sys.executable, "-c", "import horovod"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert check.returncode != 0 and "ModuleNotFoundError: import of horovod halted" in check.stderr, check.stderr
    code, out = launch_command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                "--master_port", str(_free_port()), "examples/ddp_digits.py",
                                "--compression", "thc", "--epochs", "2"],
                               env={"PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}, timeout=300)
    assert code == 0, out[-3000:]
    assert float(ACCURACY.findall(out)[-1]) >= 80.0, out[-3000:]


def test_tf_backend_without_tensorflow_says_what_to_install(tmp_path):
    """Under the ``ddp`` extra (no TensorFlow) ``import tf_backend`` fails with an ImportError
    that names the extra to install, not a bare ``No module named 'tensorflow'``."""
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["tensorflow"] = None\n')
    code = ("try:\n import tf_backend\nexcept ImportError as e:\n print('REFUSED', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED tf_backend needs TensorFlow" in out.stdout and "hvd-gradcomp[tf]" in out.stdout, out.stdout
