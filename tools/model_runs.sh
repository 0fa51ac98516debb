#!/usr/bin/env bash
# The H200 measurements the V100 model (tools/v100_model.py) is calibrated on, in one command:
#   tools/model_runs.sh LOGDIR [all|cal|v100|ncu]...   (default: all)
# cal:  the op alone over both geometries' grids on the whole GPU (bench JSON per geometry);
# v100: the same cells with a V100's grids (80 SMs of a green context, a plan for 80 SMs, CTAs
#       per SM as 96 KB of shared memory holds);
# ncu:  instructions executed, duration and issue activity of every kernel of a few cells.
# Logs: LOGDIR/{cal,v100}_{d256,d128}.{json,md,err}, LOGDIR/ncu.csv.
set -uo pipefail
out=${1:?usage: tools/model_runs.sh LOGDIR [all|cal|v100|ncu]...}
shift
stages=${*:-all}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
status=0
# The two geometries of issue 12: the seeds' (D 256, G 6, H_kv 1) and Llama-3/Qwen3-8B's
# (D 128, G 4, H_kv 8), pages 1648 and 16.
D256=(--head-dim 256 --group 6 --hkv 1 --batches 1 4 8 16 --rows 1 8 --contexts 8192 32768 131072 262144)
D128=(--head-dim 128 --group 4 --hkv 8 --batches 1 4 8 16 --rows 1 8 --contexts 8192 32768 131072)
bench() {  # bench TAG ARGS...
  local tag=$1; shift
  python3 tools/bench.py --peers none --page 1648 16 "$@" --json "$out/$tag.json" >"$out/$tag.md" 2>"$out/$tag.err" \
    || { status=1; tail -n 5 "$out/$tag.err"; }
  echo "$tag: $(grep -c '^| [0-9]' "$out/$tag.md") cells"
}
for s in $stages; do
  case $s in
    all | cal) bench cal_d256 "${D256[@]}"; bench cal_d128 "${D128[@]}" ;;&
    all | v100) bench v100_d256 --v100-grid "${D256[@]}"; bench v100_d128 --v100-grid "${D128[@]}" ;;&
    all | ncu)
      specs=()
      for c in 1,1,32768,1,6,256,1648 1,1,131072,1,6,256,1648 8,1,131072,1,6,256,1648 \
        1,8,131072,1,6,256,1648 8,8,32768,1,6,256,1648 8,8,131072,1,6,256,1648 4,8,131072,1,6,256,16 \
        1,1,32768,8,4,128,1648 8,1,131072,8,4,128,1648 8,1,131072,8,4,128,16 4,8,32768,8,4,128,1648 \
        8,8,131072,8,4,128,1648 8,8,8192,8,4,128,1648 8,8,8192,1,6,256,1648; do specs+=(--spec "$c"); done
      ncu --clock-control none --csv -k regex:"paged|combine" --metrics \
        smsp__inst_executed.sum,gpu__time_duration.sum,sm__cycles_elapsed.avg,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,launch__grid_size,launch__block_size,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers \
        python3 tools/profile_cells.py --reps 1 "${specs[@]}" >"$out/ncu.csv" 2>"$out/ncu.err" || { status=1; tail -n 5 "$out/ncu.err"; }
      echo "ncu: $(grep -c paged_attention_kernel "$out/ncu.csv") metric rows" ;;
    all | cal | v100) ;;
    *) echo "unknown stage $s"; status=2 ;;
  esac
done
exit $status
