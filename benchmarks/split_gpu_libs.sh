#!/usr/bin/env bash
# Split the staged CuTe DSL libraries (.gpu/a/libs.tar.xz from ../shared/gpu/stage.sh) into two
# parts that each travel with the working tree under the device tool's 64 MiB limit (the tree
# itself is ~6 MB; the archive alone is ~61 MiB, so the two together no longer fit: seen
# 2026-11-30). Then, on the GPU host, three calls in a row (the machine stays warm ~30 s):
#   carry [".gpu/a1"]:  cp .gpu/a1/part.aa /tmp/libs.part.aa
#   carry [".gpu/a2"]:  mkdir -p /tmp/site && cat /tmp/libs.part.aa .gpu/a2/part.ab | tar -xJf - -C /tmp/site
#   carry [".gpu/b"]:   source .gpu/b/env.sh && ...
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
archive=.gpu/a/libs.tar.xz
[[ -f $archive ]] || { echo "no $archive: run ../shared/gpu/stage.sh first" >&2; exit 1; }
rm -rf .gpu/a1 .gpu/a2
mkdir -p .gpu/a1 .gpu/a2
half=$(( ($(stat -c %s "$archive") + 1) / 2 ))
split -b "$half" "$archive" .gpu/a1/part.
mv .gpu/a1/part.ab .gpu/a2/
du -sh .gpu/a1 .gpu/a2
