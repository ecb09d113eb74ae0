#!/usr/bin/env bash
# The GPU checks of BENCHMARKS.md "On a GPU", as one command for a machine with a CUDA GPU:
#   bash benchmarks/gpu_checks.sh [OUT_DIR]       (default benchmarks/results/gpu-<UTC date>)
# The CUDA tests, then the four GPU benchmarks (each bounded by a time-out), every output in OUT_DIR/log.txt
# and each benchmark's JSON beside it. About 3 minutes on an H100 (2026-11-26: 172 s, installs not counted).
set -uo pipefail
cd "$(dirname "$0")/.."
# The interpreter: $PYTHON, else `python`, else `python3` (device images often have only the latter).
py="${PYTHON:-$(command -v python || command -v python3)}"
out="${1:-benchmarks/results/gpu-$(date -u +%Y%m%d-%H%M)}"
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "gpu_checks: $py cannot import torch; set PYTHON to an interpreter that can" >&2
  exit 2
elif ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_checks: torch sees no CUDA GPU here; these checks need one (BENCHMARKS.md, 'On a GPU')" >&2
  exit 2
fi
mkdir -p "$out" || exit 1
exec > >(tee -a "$out/log.txt") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
step() {
  local limit=$1; shift
  echo; echo "=== $(date -u +%T) [at most ${limit} s] $*"
  local start=$SECONDS
  timeout "$limit" "$@" || status=1
  echo "=== $((SECONDS - start)) s"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
"$py" -c "import sys, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'python', sys.version.split()[0])"
step 300 "$py" -m pytest -q -p no:cacheprovider -rfs tests/test_cuda.py tests/test_batched_stats.py tests/test_edits.py
step 300 "$py" benchmarks/cuda_overhead.py --out "$out/cuda_overhead.json"
step 300 "$py" benchmarks/gpu_realistic.py --device cuda --out "$out/gpu_realistic.json"
step 300 "$py" benchmarks/per_example_params.py --device cuda --repeats 20 --out "$out/per_example_params.json"
step 300 "$py" benchmarks/peers.py --per-example --device cuda --layers 12 --width 768 --seq 512 \
  --out "$out/peers_per_example.json"
echo "gpu_checks: outputs in $out (status $status)"
exit "$status"
