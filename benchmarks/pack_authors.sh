#!/usr/bin/env bash
# Pack the triadic paper's authors' kernels (cute-triadic-gdn, CuTe DSL, Hopper; MIT) with
# nvidia-cutlass-dsl 4.7.1 for the GPU machine (Python 3.12, x86-64, torch already there), as one
# xz archive split in two parts of at most 45 MB, .authors/p1 and .authors/p2: together they are over
# one device call's 64 MiB, so two calls on the same warm machine stage them. Run from the project
# root, on a machine that reaches PyPI; the source is cloned from GitHub unless AUTHORS_SRC names a
# checkout of github.com/OliverSieberling/cute-triadic-gdn. .authors/ is git-ignored.
# On the GPU machine (benchmarks/peers.py's `time_authors` then imports it):
#   call 1, carry .authors/p1:  mkdir -p /tmp/authors && cp .authors/p1/* /tmp/authors/
#   call 2, carry .authors/p2:  cp .authors/p2/* /tmp/authors/ && mkdir -p /tmp/authors_site &&
#                               cat /tmp/authors/site.txz.part-* | tar -xJ -C /tmp/authors_site
#   every call after:           export PYTHONPATH=$PYTHONPATH:/tmp/authors_site:/tmp/authors_site/nvidia_cutlass_dsl/dsl_packages
# (the second entry stands in for the wheel's .pth file, which PYTHONPATH does not read).
set -euo pipefail
grep -qx "/.authors/" .git/info/exclude 2>/dev/null || echo "/.authors/" >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
src=${AUTHORS_SRC:-}
if [ -z "$src" ]; then
  git clone -q --depth 1 https://github.com/OliverSieberling/cute-triadic-gdn "$work/src"
  src="$work/src"
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$work/wheels" \
  nvidia-cutlass-dsl==4.7.1 nvidia-cutlass-dsl-libs-base==4.7.1 nvidia-cutlass-dsl-libs-core==4.7.1 \
  nvidia-cutlass-dsl-libs-cu12==4.7.1
python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --target "$work/site" "$work"/wheels/*.whl
cp -r "$src/cute_triadic_gdn" "$src/LICENSE" "$src/NOTICE" "$work/site/"
find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
rm -rf .authors && mkdir -p .authors/p1 .authors/p2
tar -C "$work/site" -cf - . | xz -9e -T0 > "$work/site.txz"
split -b 45M "$work/site.txz" "$work/site.txz.part-"
parts=("$work"/site.txz.part-*)
[ "${#parts[@]}" -le 2 ] || { echo "pack_authors: more than two 45 MB parts" >&2; exit 1; }
mv "${parts[0]}" .authors/p1/
[ "${#parts[@]}" -eq 1 ] || mv "${parts[1]}" .authors/p2/
du -sb .authors/p1 .authors/p2
