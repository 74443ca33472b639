#!/usr/bin/env bash
# One-command set-up for hvd-gradcomp (README: `make setup`, run by `make test` and `make demo`).
#
# 1. Debian packages (Open MPI, compilers) when missing (needs root, or sudo).
# 2. A virtual environment in ./.venv (override with VENV=...).
#    HVD_GRADCOMP_SYSTEM_SITE=1 creates it with --system-site-packages, so a PyTorch or
#    TensorFlow already installed for this Python (a CUDA build, say) is used and kept.
# 3. PyTorch and TensorFlow at the versions in .ci/pins.txt, unless already importable.
# 4. Horovod built with PyTorch, TensorFlow, Gloo and MPI. The built wheel is cached in
#    ${HVD_GRADCOMP_CACHE:-$XDG_CACHE_HOME/hvd-gradcomp}/wheels/<key>, keyed by the Horovod,
#    PyTorch, TensorFlow and Python versions, so a fresh clone installs it in seconds.
# 5. This package, editable, with its dev extras.
# A second run only checks each step and skips it when done.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
pins="$root/.ci/pins.txt"
pin() { sed -n "s/^$1==//p" "$pins"; }
log() { printf '[setup] %s\n' "$*"; }

# Step 1: Debian packages.
apt_pkgs="libopenmpi-dev openmpi-bin g++ make iproute2"
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
if ! have tensorflow; then log "installing tensorflow-cpu==$(pin tensorflow-cpu)"; pip_install tensorflow-cpu; fi
need_tools=0
for m in cmake setuptools wheel cffi cloudpickle psutil yaml packaging; do have "$m" || need_tools=1; done
"$py" -c "import cmake, sys; sys.exit(0 if cmake.__version__.startswith('3.') else 1)" >/dev/null 2>&1 || need_tools=1
if [ "$need_tools" = 1 ]; then
  log "installing build tools"
  pip_install cmake setuptools wheel cffi cloudpickle psutil pyyaml packaging
fi

# Step 4: Horovod, from the wheel cache or built once.
hvd_version=$(pin horovod)
key=$("$py" - "$hvd_version" <<'EOF'
import sys, platform, torch, tensorflow as tf
print(f"horovod{sys.argv[1]}-torch{torch.__version__}-tf{tf.__version__}-py{platform.python_version()}"
      .replace("+", "_"))
EOF
)
marker="$venv/.horovod-build-key"
built_ok() {
  [ -f "$marker" ] && [ "$(cat "$marker")" = "$key" ] || return 1
  local out
  out=$("$venv/bin/horovodrun" --check-build 2>/dev/null) || return 1
  for fw in TensorFlow PyTorch MPI Gloo; do
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
    # flag to C++17 for every target (no edits to Horovod's sources; see README).
    HOROVOD_CMAKE="$root/.ci/cmake-cxx17" \
    HVD_GRADCOMP_REAL_CMAKE="$venv/bin/cmake" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
    HOROVOD_WITHOUT_MXNET=1 HOROVOD_GPU_OPERATIONS= \
    PATH="$venv/bin:$PATH" \
      "$py" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps \
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
  built_ok || { "$venv/bin/horovodrun" --check-build; echo "horovod build lacks a framework" >&2; exit 1; }
fi
log "horovod ok ($key)"

# Step 5: this package.
if ! "$py" -c "import hvd_gradcomp, torch_backend, tf_backend, pytest, sklearn, matplotlib, tqdm" >/dev/null 2>&1; then
  log "installing hvd-gradcomp (editable) with dev extras"
  pip_install --no-build-isolation -e ".[dev]"
fi
log "ready: $py"
