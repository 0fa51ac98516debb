#!/usr/bin/env bash
# The NVRTC route against the nvcc build it replaced, on one GPU, side by side: the machine code
# of every kernel (cuobjdump -xelf of the nvcc library against the NVRTC cubins: tools/sass_diff.py),
# host time per call (tools/host_overhead.py against each tree), the first calls' cost
# (tools/first_call.py) and the benchmark's headline cells (tools/ab_bench.sh). The old tree is
# built by its own JIT build (nvcc, for this GPU's arch); this tree uses no toolkit.
#   tools/route_ab.sh LOGDIR OLD_TREE [bench.py arguments]
set -uo pipefail
out=${1:?usage: tools/route_ab.sh LOGDIR OLD_TREE [bench.py arguments]}
old=$(cd "${2:?no old tree}" && pwd) || exit 2
shift 2
cd "$(dirname "$0")/.."
new=$PWD
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
if compgen -G ".whl/*.whl" >/dev/null; then  # wheels the GPU machine lacks (as gpu_suite.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# the old JIT build's target: TORCH_CUDA_ARCH_LIST as set (9.0a on the H200 image: the calibration
# runs' code), else this GPU's
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')}
in_tree() { local t=$1; shift; (cd "$t" && PYTHONPATH=$t${PYTHONPATH:+:$PYTHONPATH} "$@"); }
(in_tree "$old" python3 -m torch_sm70attn build) >"$out/build-old.log" 2>&1 &
in_tree "$new" python3 -m torch_sm70attn build >"$out/build-new.log" 2>&1
wait
tail -n 2 "$out/build-old.log" "$out/build-new.log"
lib=$(in_tree "$old" python3 -c 'from torch_sm70attn import _jit; d = _jit.source_digest(); print(next(_jit.build_dir(d).glob(_jit.module_name(d) + "*.so")))')
cubins=$(in_tree "$new" python3 -c "import torch; from torch_sm70attn import nvrtc; print(nvrtc.cache_dir(nvrtc.device_arch(0)))")
rm -rf /tmp/route_ab_sass && mkdir -p /tmp/route_ab_sass && (cd /tmp/route_ab_sass && cuobjdump -xelf all "$lib" >/dev/null)
python3 tools/sass_diff.py /tmp/route_ab_sass "$cubins" --json "$out/sass_diff.json" >"$out/sass_diff.txt"
tail -n 1 "$out/sass_diff.txt"
for t in old new; do
  tree=$old; [ $t = new ] && tree=$new
  in_tree "$tree" python3 "$new/tools/host_overhead.py" --json "$out/host-$t.json" | tee "$out/host-$t.txt"
done
in_tree "$new" python3 tools/first_call.py --json "$out/first_call.json" >/dev/null && cat "$out/first_call.json"
[ $# -gt 0 ] && tools/ab_bench.sh "$out/ab" "$old" "$new" -- "$@"
