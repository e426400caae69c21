#!/usr/bin/env bash
# Pack the PyTorch peers (FLA, FlashQLA + TileLang) and the project's own wheels for the GPU machine
# (Python 3.12, x86-64) as one archive, .peers/site.txz (~41 MB, under one device call's 64 MiB),
# from the wheels that ../shared/device/wheels.sh qla downloads. Run from the project root.
# On the GPU machine (carry .peers; benchmarks/device_steps.sh does the unpacking and the cache
# variables):
#   mkdir -p /tmp/site && tar -C /tmp/site -xJf .peers/site.txz && export PYTHONPATH=.:/tmp/site
# To keep the peers' compiled kernels between calls, run once there with
#   TILELANG_CACHE_DIR=/tmp/cache/tl TRITON_CACHE_DIR=/tmp/cache/tr \
#     python3 benchmarks/peers.py --warm 16384 65536
# and send `tar -C /tmp/cache -czf - . | split -b 15M - $OUT/cache.tgz.` back; unpack it into
# /tmp/cache (same variables) at the start of the next call.
set -euo pipefail
[ -d .whl-qla2 ] || bash ../shared/device/wheels.sh qla
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --target "$site" .whl/*.whl .whl-qla1/*.whl .whl-qla2/tilelang*.whl
# z3 ships its library twice and a 22 MB binary that TileLang does not run: keep one library.
(cd "$site/z3/lib" && rm -f libz3.so.4.15 && ln -s libz3.so libz3.so.4.15)
rm -f "$site/bin/z3"
find "$site" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p .peers
tar -C "$site" -cJf .peers/site.txz .
rm -rf "$site"
ls -la .peers/site.txz
