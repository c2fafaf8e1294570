#!/bin/bash
# One GPU sitting on the H200 host: runs each quoted step with its own time limit, logs each to
# $OUT/logs/<name>.txt and packs everything under $OUT into one archive, $OUT/sitting.tgz (the
# device tool brings back only a few files per call). Run from the project root after
# `bash .gpu/a/unpack.sh`, e.g.
#   bash benchmarks/gpu_sitting.sh "step info 60 python3 -m vsa_core.cli info" \
#     "step grid 300 python3 benchmarks/bench_vsa.py --out \$OUT/grid.json"
source .gpu/b/env.sh || exit 1
# The backends come from the project's wheels' entry points: a .gpu/b staged where uv was not
# on PATH has none of them, and every fa4 and triton test would skip (session 33, first sitting)
python3 -c '
from vsa_core.backends import backend_entries
missing = {"reference", "triton", "fa4"} - set(backend_entries())
if missing:
    raise SystemExit(f"gpu sitting: backends {sorted(missing)} not registered: .gpu/b lacks "
                     "the project wheels (run ../shared/gpu/stage.sh with uv on PATH)")
' || exit 1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}
mkdir -p "$OUT/logs"
step() {
  local name=$1 limit=$2 t0
  shift 2
  t0=$(date +%s)
  # SIGINT at the limit (SIGKILL 15 s later): pytest then prints the failures it has so far
  # and Python its traceback, where SIGTERM would lose them with the step's log
  timeout -s INT -k 15 "$limit" "$@" >"$OUT/logs/$name.txt" 2>&1
  echo "$name rc=$? $(($(date +%s) - t0))s" | tee -a "$OUT/logs/steps.txt"
}
for s in "$@"; do eval "$s"; done
(cd "$OUT" && tar czf /tmp/sitting.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/sitting.tgz "$OUT/")
