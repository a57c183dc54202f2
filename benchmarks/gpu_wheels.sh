#!/usr/bin/env bash
# What the GPU benchmarks need on the lent H200 image (Python 3.12, torch 2.11, no vLLM), fetched here:
#   .whl/              the wheels the image lacks (the versions this checkout's .venv runs), installed there with
#                      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   .gpu/vllm-py.tgz   vLLM's Python sources without its compiled parts: enough to import the connector (its
#                      KVConnectorBase_V1 and metrics) next to the image's torch; unpack into /tmp/site there.
#   .gpu/site/tilert-*.dist-info   this checkout's package metadata (its entry points: the engine and transport
#                      plugins), so that the source tree on PYTHONPATH finds its plugins; copy into /tmp/site there.
# Both paths are ignored by git; carry them to the device machine. Run from the repository root after `make setup`.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl)
for n in 17 24 26 27 28 31 34; do PIP+=(--platform "manylinux_2_${n}_x86_64"); done
PIP+=(--platform manylinux2014_x86_64)
# the engine and the serving path (orjson ... xgrammar), then what importing vLLM's connector modules pulls in
NAMES="orjson msgspec structlog starlette uvicorn tenacity xgrammar apache-tvm-ffi pydantic pydantic-core
annotated-types typing-inspection pyzmq cachetools cbor2 blake3 pybase64 setproctitle httpx2 httpcore2 brotli dill
email-validator dnspython fastapi greenlet llguidance openai jiter sniffio oss-harmony distro partial-json-parser
pydantic-extra-types python-multipart truststore httptools uvloop"
mkdir -p .whl .gpu
for name in $NAMES; do
  version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null || true)
  "${PIP[@]}" "$name${version:+==$version}"
done
site=$(.venv/bin/python -c "import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))")
tar -C "$site" --exclude='*.so' --exclude=__pycache__ --exclude=vllm/third_party --exclude=vllm/vllm_flash_attn \
  -czf .gpu/vllm-py.tgz vllm
rm -rf .gpu/site && mkdir -p .gpu/site
cp -r "$site"/tilert-*.dist-info .gpu/site/
rm -f .gpu/site/tilert-*.dist-info/{RECORD,direct_url.json}
du -sh .whl .gpu/vllm-py.tgz .gpu/site
