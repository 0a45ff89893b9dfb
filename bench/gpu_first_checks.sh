#!/usr/bin/env bash
# The first minutes on a lent GPU machine (one GPU or several, PyTorch + CUDA, no package
# registry, only this repository copied over; vLLM's CUDA build there or not), in one call of
# under 8 minutes (each step under its own time limit), writing ONE result file:
# $OUT/gpu_first_checks.jsonl (default OUT: bench/results), one JSON line a step:
#
#   env       GPUs (nvidia-smi), torch / CUDA versions, whether vLLM and omegaconf import
#   gpu_tests pytest -m gpu (setup.cfg's marker) over the files that carry it: passed, failed,
#             skipped and the tail of the output
#   mfu_0.5b  bench/trainer_throughput.py: the 0.5B GRPO update (Qwen2.5-0.5B's architecture,
#             bf16 over float32 master weights, 64 x (256 + 768) tokens, the recipe's 16384-token
#             packed micro-batches, activation budget 0.9), its seconds, tokens/s, MFU (against
#             the card's dense bf16 peak, when the card is known) and peak memory
#   kv_room   bench/engine_kv_room.py: a vLLM engine's KV cache beside whole-model receive
#             buffers and beside bucketed ones (vLLM's CUDA build only; a 'skipped' line else)
#
# It installs nothing. llamarl's config needs omegaconf (pure Python), which such machines
# lack: `bash bench/gpu_first_checks.sh --prepare` (here) zips omegaconf (and its antlr4 runtime
# where it does not vendor it) and PyYAML from this Python into .gpu_deps/pure.zip (git-ignored: carry it), and the script
# puts that zip on PYTHONPATH (zipimport) when omegaconf does not import.
#
#   bash bench/gpu_first_checks.sh --dry-run   # checks that everything it would run is here
#   bash bench/gpu_first_checks.sh             # on the GPU machine
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
DEPS=.gpu_deps/pure.zip
GPU_TEST_FILES=(tests/test_gpu.py tests/test_reward_model.py)
STEPS=(env gpu_tests mfu_0.5b kv_room)
declare -A LIMIT=([env]=30 [gpu_tests]=200 [mfu_0.5b]=140 [kv_room]=100)  # 470 s in all
MFU_ARGS=(--model 0.5b --dtype bfloat16 --seqs 64 --prompt-len 256 --completion-len 768
          --repeats 3 --variant packed --budget 16384
          --set trainer.activation_memory_budget=0.9 --set trainer.compile=true)

if [ "${1:-}" = "--prepare" ]; then
  mkdir -p .gpu_deps
  "$PY" - "$DEPS" <<'EOF'
import importlib, sys, zipfile
from pathlib import Path
with zipfile.ZipFile(sys.argv[1], "w", zipfile.ZIP_DEFLATED) as z:
    for name in ("omegaconf", "yaml", "antlr4"):  # omegaconf >= 2.4 vendors its antlr4
        try:
            pkg = Path(importlib.import_module(name).__file__).parent
        except ImportError:
            continue
        for f in pkg.rglob("*.py"):
            z.write(f, f.relative_to(pkg.parent))
print("wrote", sys.argv[1])
EOF
  exit $?
fi

if [ "${1:-}" = "--dry-run" ]; then
  # Everything a run would use must be here, and every Python file must compile.
  missing=0
  for f in "${GPU_TEST_FILES[@]}" bench/trainer_throughput.py bench/engine_kv_room.py \
           tests/conftest.py setup.cfg; do
    [ -f "$f" ] || { echo "missing: $f"; missing=1; }
  done
  for f in "${GPU_TEST_FILES[@]}"; do
    grep -q "pytest.mark.gpu" "$f" || { echo "no gpu mark in $f"; missing=1; }
  done
  grep -q "^    gpu:" setup.cfg || { echo "setup.cfg declares no gpu marker"; missing=1; }
  "$PY" -m py_compile bench/trainer_throughput.py bench/engine_kv_room.py || missing=1
  # the throughput bench must take every argument the run passes it
  for a in "${MFU_ARGS[@]}" --peak-tflops --label; do
    case $a in --*) grep -q -- "\"$a\"" bench/trainer_throughput.py \
      || { echo "bench/trainer_throughput.py takes no $a"; missing=1; } ;; esac
  done
  for s in "${STEPS[@]}"; do echo "would run: $s (limit ${LIMIT[$s]} s)"; done
  total=0; for s in "${STEPS[@]}"; do total=$((total + LIMIT[$s])); done
  [ "$total" -le 480 ] || { echo "limits add up to $total s: over 8 minutes"; missing=1; }
  [ "$missing" = 0 ] && echo "dry run: ok ($total s of limits)"
  exit "$missing"
fi

OUT=${OUT:-$ROOT/bench/results}
mkdir -p "$OUT"
RESULT=$OUT/gpu_first_checks.jsonl
: >"$RESULT"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
if ! "$PY" -c "import omegaconf" 2>/dev/null && [ -f "$DEPS" ]; then
  export PYTHONPATH=$PYTHONPATH:$ROOT/$DEPS
fi
LOGDIR=$(mktemp -d)

record() {  # step, rc, seconds, file whose text goes in as 'output' (last 3000 chars)
  "$PY" - "$@" >>"$RESULT" <<'EOF'
import json, sys
step, rc, secs, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
text = open(path, errors="replace").read()
line = {"step": step, "rc": rc, "seconds": secs, "timed_out": rc in (124, 137)}
for tag in ("ENV ", "ENGINE_KV_ROOM "):  # a step's own JSON line
    for row in text.splitlines():
        if row.startswith(tag):
            line.update(json.loads(row[len(tag):]))
if step == "gpu_tests":
    import re
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|error)", text):
        line[what] = int(n)
if step == "mfu_0.5b" and "{" in text:
    try:
        run = json.loads(text[text.index("{"):text.rindex("}") + 1])
        line.update(device=run.get("device"), **run["results"]["grpo"])
    except (ValueError, KeyError) as e:
        line["parse_error"] = repr(e)
line["output"] = text[-3000:]
print(json.dumps(line))
EOF
  tail -1 "$RESULT" | cut -c1-300
}

step() {  # name, command...
  local name=$1 t0=$SECONDS
  shift
  echo "== $name (limit ${LIMIT[$name]} s)"
  timeout -k 10 "${LIMIT[$name]}" "$@" >"$LOGDIR/$name.txt" 2>&1
  record "$name" $? $((SECONDS - t0)) "$LOGDIR/$name.txt"
}

step env "$PY" - <<'EOF'
import json, subprocess
import torch
def imports(name):
    try:
        __import__(name)
        return True
    except Exception as e:  # noqa: BLE001 - any failure means: not usable here
        return repr(e)[:200]
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                      "--format=csv,noheader"], capture_output=True, text=True)
print("ENV " + json.dumps({
    "torch": torch.__version__, "cuda": torch.version.cuda,
    "gpus": torch.cuda.device_count(), "nvidia_smi": smi.stdout.strip().splitlines(),
    "vllm": imports("vllm"), "omegaconf": imports("omegaconf"),
    "transformers": imports("transformers"), "pytest": imports("pytest")}))
EOF

step gpu_tests "$PY" -m pytest -q -p no:cacheprovider -m gpu "${GPU_TEST_FILES[@]}"

# the card's dense bf16 peak, for the MFU (H100 / H200 SXM 989 TFLOP/s, A100 312)
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case $NAME in
  *H100*|*H200*) PEAK=(--peak-tflops 989) ;;
  *A100*) PEAK=(--peak-tflops 312) ;;
  *) PEAK=() ;;
esac
step mfu_0.5b "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
  bench/trainer_throughput.py "${MFU_ARGS[@]}" "${PEAK[@]}" --label first_checks

if "$PY" -c "import torch; from vllm.platforms import current_platform as p; assert torch.cuda.is_available() and p.is_cuda()" 2>/dev/null; then
  step kv_room "$PY" bench/engine_kv_room.py --utilization 0.5
else
  echo '{"step": "kv_room", "skipped": "vLLM (its CUDA build) does not import here"}' \
    >>"$RESULT"
  tail -1 "$RESULT"
fi
rm -rf "$LOGDIR"
echo "result: $RESULT"
