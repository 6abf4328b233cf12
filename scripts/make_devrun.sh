#!/usr/bin/env bash
# Gather what the GPU machine's image lacks into .devrun/ (ignored by git; carried by the device tool).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .devrun/whl .devrun/bin .devrun/lib
for spec in grpcio grpcio-tools protobuf redis structlog fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn \
            openai distro jiter sniffio annotated-doc opentelemetry-api hiredis httptools; do
  version=$(python3 -m pip show "$spec" 2>/dev/null | awk '/^Version:/{print $2}')
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .devrun/whl "${spec}${version:+==$version}"
done
cp "$(readlink -f "$(command -v redis-server)")" .devrun/bin/redis-server
cp -L /lib/x86_64-linux-gnu/liblzf.so.1 /lib/x86_64-linux-gnu/libjemalloc.so.2 .devrun/lib/
