#!/usr/bin/env bash
# Run benchmark commands as steps of one call on a lent GPU machine, each under its own timeout,
# with the PyTorch peers and their compile caches set up the way benchmarks/pack_peers.sh and
# pack_authors.sh leave them. Run from the project root there:
#
#   TO=290 bash benchmarks/device_steps.sh "python3 benchmarks/triadic_kernels.py --t 16384 --e 8" \
#       "timeout 140 python3 benchmarks/merlin_ops.py --T 2048"
#
# - carry .peers (its site.txz is unpacked into /tmp/site once per machine; cache.tgz.* parts, if
#   present, into /tmp/cache); without it the project's own code runs alone (peers are skipped);
# - PYTHONPATH gets the project, /tmp/site and the authors' kernels where pack_authors.sh's calls
#   staged them (/tmp/authors_site);
# - JAX's persistent compilation cache is /tmp/cache/jax (unless JAX_COMPILATION_CACHE_DIR is set),
#   so that a later step or call on the same warm machine does not compile the same program again
#   (compile times a benchmark prints, e.g. train_step.py's first step, are then a cache hit's);
# - TO (seconds, default 280) bounds each step; a step's own `timeout N` can cut it shorter;
# - each step's output goes to $OUT/stepN.log (complete) and to stdout without warning lines.
set -u
export PYTHONPATH=.:/tmp/site:/tmp/authors_site:/tmp/authors_site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
export TILELANG_CACHE_DIR=/tmp/cache/tl TRITON_CACHE_DIR=/tmp/cache/tr
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/cache/jax}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-1}
mkdir -p /tmp/site /tmp/cache
if [ -f .peers/site.txz ] && [ ! -f /tmp/site/.unpacked ]; then
  t0=$(date +%s)
  tar -C /tmp/site -xJf .peers/site.txz && touch /tmp/site/.unpacked
  echo "[steps] peers unpacked in $(( $(date +%s) - t0 )) s"
fi
if compgen -G ".peers/cache.tgz.*" > /dev/null && [ ! -f /tmp/cache/.unpacked ]; then
  cat .peers/cache.tgz.* | tar -C /tmp/cache -xzf - && touch /tmp/cache/.unpacked
  echo "[steps] compile caches unpacked"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
TO=${TO:-280}
i=0
for cmd in "$@"; do
  i=$((i + 1))
  echo "=== step $i: $cmd"
  t0=$(date +%s)
  timeout -k 5 "$TO" bash -c "$cmd" 2>&1 | tee "${OUT:-/tmp}/step$i.log" \
    | grep -v -e '^WARNING' -e '^W[0-9]\{4\} ' -e 'UserWarning' -e 'warnings.warn'
  echo "=== step $i: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
done
