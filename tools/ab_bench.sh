#!/usr/bin/env bash
# Benchmark several source trees of this project side by side on one GPU, one after another
# in one session (kernel A/B tests): each tree's CUDA library is built first (in parallel,
# each under its own source digest), then tools/bench.py of each tree runs the same cells.
#   tools/ab_bench.sh LOGDIR TREE [TREE...] -- [bench.py arguments]
# e.g. a copy of the last commit next to the working tree:
#   mkdir -p /tmp/base && git archive HEAD | tar -x -C /tmp/base
#   tools/ab_bench.sh /tmp/ab /tmp/base . -- --batches 1 8 --rows 1 8 --contexts 131072 --hkv 1 --peers none
# Logs: LOGDIR/<n>-<tree name>.{build.log,md,json,err}; the tables are printed last.
set -uo pipefail
out=${1:?usage: tools/ab_bench.sh LOGDIR TREE [TREE...] -- [bench.py arguments]}
shift
trees=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  d=$(cd "$1" 2>/dev/null && pwd) || { echo "no such tree: $1" >&2; exit 2; }
  trees+=("$d")
  shift
done
[ $# -gt 0 ] && shift
[ ${#trees[@]} -gt 0 ] || { echo "no trees given" >&2; exit 2; }
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')}
tag() { printf '%d-%s' "$1" "$(basename "$2")"; }
status=0
i=0
for t in "${trees[@]}"; do
  (cd "$t" && PYTHONPATH=$t${PYTHONPATH:+:$PYTHONPATH} python3 -m torch_sm70attn build >"$out/$(tag $i "$t").build.log" 2>&1) &
  i=$((i + 1))
done
wait
i=0
for t in "${trees[@]}"; do
  n=$(tag $i "$t")
  echo "== $n: $(tail -n 2 "$out/$n.build.log" | head -n 1)"
  (cd "$t" && PYTHONPATH=$t${PYTHONPATH:+:$PYTHONPATH} python3 tools/bench.py "$@" --json "$out/$n.json" >"$out/$n.md" 2>"$out/$n.err") || status=1
  i=$((i + 1))
done
i=0
for t in "${trees[@]}"; do
  n=$(tag $i "$t")
  echo "== $n"
  grep -E '^\|' "$out/$n.md" | cut -d'|' -f2-9,14-16 || tail -n 5 "$out/$n.err"
  i=$((i + 1))
done
exit $status
