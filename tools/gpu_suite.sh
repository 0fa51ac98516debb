#!/usr/bin/env bash
# One GPU session in one command: build the CUDA binding and every kernel, run the CUDA tests,
# compute-sanitizer passes (memcheck over small problems; memcheck, racecheck, synccheck and
# initcheck over every kernel the launcher can pick), and the benchmark smoke. As on a V100 user's
# machine, no CUDA toolkit is used: nvcc is taken off PATH and CUDA_HOME unset, the binding is
# built by the host compiler and the kernels by NVRTC from the pip packages (the build step fails
# if the binding's build names a toolkit folder).
#   tools/gpu_suite.sh LOGDIR [pytest -k expression]
# SUITE_STEPS="tests all-memcheck ..." runs only the steps named (info, deps, build and no-toolkit always
# run).
# Logs: LOGDIR/{info,build,tests,sanitizer,all-<tool>,bench}.log, LOGDIR/bench.json,
# LOGDIR/junit.xml.
# Wheels for packages the GPU machine lacks may sit in .whl/ (installed to /tmp/site).
set -uo pipefail
out=${1:?usage: tools/gpu_suite.sh LOGDIR [pytest -k expression]}
sel=${2:-}
mkdir -p "$out"
rm -f "$out"/*.log "$out/junit.xml" "$out/bench.json"  # a reused LOGDIR shows this run's logs only
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
sanitizer=$(command -v compute-sanitizer) || { echo "compute-sanitizer not found"; exit 1; }
toolkit=$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")
unset CUDA_HOME CUDA_PATH TORCH_CUDA_ARCH_LIST  # (build: this GPU's arch, as the runtime does)
PATH=$(printf '%s' "$PATH" | tr ':' '\n' | while read -r d; do [ -x "$d/nvcc" ] || printf '%s:' "$d"; done)
export PATH=${PATH%:}
if command -v nvcc >/dev/null; then echo "nvcc is still on PATH"; exit 1; fi
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 \
  || { echo "editable install failed, using PYTHONPATH"; export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; }
status=0
step() {  # step NAME CMD...: run, log, remember failure, print one line
  local name=$1; shift
  if [ -n "${SUITE_STEPS:-}" ] && [[ " info deps build no-toolkit $SUITE_STEPS " != *" $name "* ]]; then return; fi
  local t0=$SECONDS
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && status=1
  printf '%-10s rc=%d %4ds  %s\n' "$name" $rc $((SECONDS - t0)) "$(tail -n 1 "$out/$name.log")"
}
step info python3 -m torch_sm70attn info
# the test extras the CUDA tests need (a GPU machine's own transformers may be older than the
# hf extra's: its transformers tests then fail on generate's arguments, not on this package)
step deps python3 -c 'import importlib.metadata as m, sys
need = {"transformers": (5, 24), "expecttest": (0,)}
bad = []
for n, v in need.items():
    try:
        have = m.version(n)
    except m.PackageNotFoundError:
        bad.append(f"{n} missing"); continue
    want = ".".join(map(str, v))
    if tuple(int(x) for x in have.split(".")[:len(v)] if x.isdigit()) < v:
        bad.append(f"{n} {have} < {want}")
        continue
    try:  # a carried wheel may not import beside the machine own packages
        __import__(n)
    except Exception as e:
        bad.append(f"{n} {have} does not import: {e!r}"[:300])
print("; ".join(bad) + ": carry wheels in .whl/" if bad else "test extras present")
sys.exit(1 if bad else 0)'
step build python3 -m torch_sm70attn build
# the binding's build line holds no toolkit folder (its CUDA headers are the pip packages')
ninja_file=$(python3 -c 'from torch_sm70attn import _jit; print(_jit.build_dir(_jit.source_digest()) / "build.ninja")')
step no-toolkit bash -c "! grep -n -e '$toolkit' -e nvcc '$ninja_file' && echo 'no toolkit in $ninja_file'"
# The CPU tests run in CI; here the CUDA ones (and the demo through them).
step tests python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$out/junit.xml" ${sel:+-k "$sel"} \
  tests/test_cuda.py tests/test_compile_cuda.py tests/test_transformers_cuda.py tests/test_readme.py \
  tests/test_adversarial.py tests/test_jit.py tests/test_varlen_cuda.py
step sanitizer "$sanitizer" --tool memcheck --error-exitcode 1 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k sanitizer_smoke
# Every kernel the launcher can pick (tools/sanitize_cells.py: 105 small cells) under each tool.
for tool in memcheck racecheck synccheck initcheck; do
  extra=(); [ "$tool" = memcheck ] && extra=(--sweep 40)  # and 40 random calls under memcheck
  step "all-$tool" "$sanitizer" --tool "$tool" --error-exitcode 1 python3 tools/sanitize_cells.py "${extra[@]}"
done
if [ -f tools/bench.py ]; then
  step bench python3 tools/bench.py --smoke --json "$out/bench.json"
fi
[ -f "$out/tests.log" ] && { echo "--- tests (tail)"; tail -n 25 "$out/tests.log"; }
[ -f "$out/sanitizer.log" ] && { echo "--- sanitizer (tail)"; tail -n 5 "$out/sanitizer.log"; }
[ -f "$out/bench.log" ] && { echo "--- bench (tail)"; tail -n 30 "$out/bench.log"; }
exit $status
