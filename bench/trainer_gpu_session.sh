#!/usr/bin/env bash
# The trainer's GPU measurements of issue 18 in one call, for a lent GPU machine that has
# PyTorch and CUDA but no package registry: the packed GPU tests, then the 0.5B GRPO update
# (bench/trainer_throughput.py: Qwen2.5-0.5B's architecture, bf16 compute over float32
# master weights, 64 x (256 + 768) tokens, packed micro-batches of 8192 tokens,
# trainer.compile) in variants side by side on the same machine, most important first, each
# in its own process under its own time limit:
#
#   new        this checkout, with a profile of one update and the places the host waits
#   old        the code of BASE (extracted to .bench_old/ beforehand, see below)
#   untraced   new, the varlen attention called from outside the compiled blocks
#   budget16k  new, 16384-token micro-batches
#   padded     new, 8 padded rows per micro-batch, whole logits
#   unfused    new, trainer.compile compiling the head's in-place softmax passes
#   budget12k  new, 12288-token micro-batches
#   amb08_16k  16384-token micro-batches, trainer.activation_memory_budget=0.8 (the compiled
#              blocks keep at most 80% of their activations for backward)
#   amb07_16k, amb06_16k, amb05_16k, amb07_20k  other budgets and micro-batch sizes
#   plain      new without the profile
#   recipe     the 0.5B GPU recipe's update (16384-token micro-batches, budget 0.9), profiled
#   r16        16384-token micro-batches, budget 0.8 (the recipe before 2026-11-26), profiled
#   r16_rowbound  r16 with the varlen kernel told the row's length as its longest sequence
#   amb09_16k, nob16k (no budget), amb07_32k, amb06_32k  around the recipe's settings
#   combo      the recipe's settings (amb09_16k), inductor's combo kernels (fewer launches
#              in the host-bound backward)
#   expseg     amb09_16k with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
#   amb095_16k budget 0.95; amb08_24k 24576-token micro-batches (3 per update), budget 0.8
#   keep16k    amb09_16k, every block keeping its unsharded parameters forward to backward
#   gath16k    amb09_16k with trainer.keep_gathered_params (each block gathered once a step);
#              gath16k_085 the same at budget 0.85, gath24k_08 with amb08_24k's settings
#   gath16k_c512, gath16k_c256  gath16k with the head's float32 chunks at 512 (256) MiB instead
#              of 1 GiB (the peak of the update is in the head's backward); _na the same without
#              inductor's size asserts (host work per compiled graph), _cdt with inductor's
#              coordinate-descent tuning of its pointwise and reduction kernels, _prof profiled
#   cudag_gath the recipe's settings (gath16k) with inductor's CUDA graphs: the gathered
#              parameters are held through the step, so a block's graphs could replay within it
#              (measured: 1.89 s, cudagraph trees off their fast path with backwards pending);
#              cudag_gath_notrees the same with inductor's older per-graph CUDA graphs (run on an
#              H100 2026-11-28: fails in its first update, inductor's compile_fx.py asserting
#              `dst.data_ptr() == src.data_ptr()`: a static input moved between replays)
#   cudag, cudag_keep  amb09_16k (and keep16k) with inductor's CUDA graphs over each compiled
#              block (the bench's rows are all 16384 tokens: static shapes), to measure what
#              the host's launch work costs the host-bound backward
# (Inductor's C++ wrapper, tried with --torch-config torch._inductor.config.cpp_wrapper=True,
# does not compile the varlen attention op in torch 2.11.)
#
# Prepare here (omegaconf is not on those machines; .whl and .bench_old are git-ignored):
#   mkdir -p .whl && pip download --no-deps omegaconf==2.3.0 -d .whl &&
#     pip wheel --no-deps antlr4-python3-runtime==4.9.3 -w .whl
#   mkdir -p .bench_old && git archive BASE llamarl | tar -x -C .bench_old
# then run `bash bench/trainer_gpu_session.sh [VARIANT ...]` there with .whl and .bench_old
# carried (default: all of them).
# Results: $OUT/results.jsonl (one JSON line per variant), $OUT/log.txt (everything else).
set -u
OUT=${OUT:-/tmp/trainer_gpu_session}
mkdir -p "$OUT"
LOG=$OUT/log.txt
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
ROOT=$PWD
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
{
  date
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee -a "$LOG"

[ -n "${NO_TESTS:-}" ] || echo "== GPU tests (packed = padded on CUDA)" | tee -a "$LOG"
[ -n "${NO_TESTS:-}" ] || timeout "${TEST_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k packed 2>&1 \
  | tail -15 | tee -a "$LOG"

COMMON=(--model 0.5b --dtype bfloat16 --seqs 64 --prompt-len 256 --completion-len 768
        --repeats 5 --peak-tflops 989 --set trainer.compile=true)

variant() {  # label, seconds, PYTHONPATH prefix, bench arguments...
  local label=$1 limit=$2 prefix=$3
  shift 3
  echo "== $label: $* ${VENV[$label]:-}" | tee -a "$LOG"
  local t0=$SECONDS
  env TORCH_LOGS=graph_breaks,recompiles ${VENV[$label]:-} PYTHONPATH=$prefix$PYTHONPATH timeout "$limit" \
    torchrun --standalone --nproc-per-node 1 bench/trainer_throughput.py "${COMMON[@]}" \
    --label "$label" "$@" >"$OUT/$label.out" 2>"$OUT/$label.err"
  local rc=$?
  echo "rc $rc in $((SECONDS - t0)) s; graph-break lines: $(grep -c -i 'graph break' \
    "$OUT/$label.err"), recompile lines: $(grep -c -i 'recompil' "$OUT/$label.err")" \
    | tee -a "$LOG"
  python3 - "$label" "$OUT/$label.out" >>"$OUT/results.jsonl" <<'EOF'
import json, sys
text = open(sys.argv[2]).read()
try:
    run = json.loads(text[text.index("{"):])
    r = run["results"]["grpo"]
    print(json.dumps({"label": sys.argv[1], "device": run["device"], **r}))
except Exception as e:
    print(json.dumps({"label": sys.argv[1], "error": repr(e)}))
EOF
  tail -1 "$OUT/results.jsonl" | cut -c1-400 | tee -a "$LOG"
  grep -v -i "graph break\|recompil\|^\s*$" "$OUT/$label.err" | tail -40 >>"$LOG"
  case " $* " in *" --profile "*) mv "$OUT/$label.err" "$OUT/${label}_stderr.txt" ;; esac
  rm -f "$OUT/$label.out" "$OUT/$label.err"
}

# variant name -> its arguments (beyond COMMON)
AMB="--set trainer.activation_memory_budget"
declare -A ARGS=(
  [new]="--variant packed --budget 8192 --profile --sync-debug"
  [old]="--variant packed --budget 8192"
  [unfused]="--variant packed --budget 8192 --unfused-head"
  [untraced]="--variant packed --budget 8192 --no-trace-varlen"
  [budget12k]="--variant packed --budget 12288"
  [budget16k]="--variant packed --budget 16384"
  [padded]="--variant padded --micro-batch 8"
  [amb05_16k]="--variant packed --budget 16384 $AMB=0.5"
  [amb07_16k]="--variant packed --budget 16384 $AMB=0.7"
  [amb06_16k]="--variant packed --budget 16384 $AMB=0.6"
  [amb08_16k]="--variant packed --budget 16384 $AMB=0.8"
  [amb07_20k]="--variant packed --budget 20480 $AMB=0.7"
  [plain]="--variant packed --budget 8192"
  [recipe]="--variant packed --budget 16384 $AMB=0.9 --profile --sync-debug"
  [r16]="--variant packed --budget 16384 $AMB=0.8 --profile --sync-debug"
  [r16_rowbound]="--variant packed --budget 16384 $AMB=0.8 --row-length-bound"
  [amb09_16k]="--variant packed --budget 16384 $AMB=0.9"
  [nob16k]="--variant packed --budget 16384"
  [amb07_32k]="--variant packed --budget 32768 $AMB=0.7"
  [amb06_32k]="--variant packed --budget 32768 $AMB=0.6"
  [combo]="--variant packed --budget 16384 $AMB=0.9 --torch-config torch._inductor.config.combo_kernels=True"
  [expseg]="--variant packed --budget 16384 $AMB=0.9"
  [amb095_16k]="--variant packed --budget 16384 $AMB=0.95"
  [amb08_24k]="--variant packed --budget 24576 $AMB=0.8"
  [keep16k]="--variant packed --budget 16384 $AMB=0.9 --keep-unsharded"
  [gath16k]="--variant packed --budget 16384 $AMB=0.9 --set trainer.keep_gathered_params=true"
  [gath16k_085]="--variant packed --budget 16384 $AMB=0.85 --set trainer.keep_gathered_params=true"
  [gath24k_08]="--variant packed --budget 24576 $AMB=0.8 --set trainer.keep_gathered_params=true"
  [gath16k_c512]="--variant packed --budget 16384 $AMB=0.9 --set trainer.keep_gathered_params=true --chunk-mib 512"
  [gath16k_c256]="--variant packed --budget 16384 $AMB=0.9 --set trainer.keep_gathered_params=true --chunk-mib 256"
  [gath16k_c512_na]="--variant packed --budget 16384 $AMB=0.9 --set trainer.keep_gathered_params=true --chunk-mib 512 --torch-config torch._inductor.config.size_asserts=False"
  [gath16k_c512_cdt]="--variant packed --budget 16384 $AMB=0.9 --set trainer.keep_gathered_params=true --chunk-mib 512 --torch-config torch._inductor.config.coordinate_descent_tuning=True"
  [gath16k_c512_prof]="--variant packed --budget 16384 $AMB=0.9 --set trainer.keep_gathered_params=true --chunk-mib 512 --profile"
  [cudag]="--variant packed --budget 16384 $AMB=0.9 --torch-config torch._inductor.config.triton.cudagraphs=True"
  [cudag_keep]="--variant packed --budget 16384 $AMB=0.9 --keep-unsharded --torch-config torch._inductor.config.triton.cudagraphs=True"
  [cudag_gath]="--variant packed --budget 16384 $AMB=0.9 --set trainer.keep_gathered_params=true --torch-config torch._inductor.config.triton.cudagraphs=True"
  [cudag_gath_notrees]="--variant packed --budget 16384 $AMB=0.9 --set trainer.keep_gathered_params=true --torch-config torch._inductor.config.triton.cudagraphs=True --torch-config torch._inductor.config.triton.cudagraph_trees=False"
)
# variant name -> environment variables for its process
declare -A VENV=(
  [expseg]="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
  [cudag]="TORCH_LOGS=graph_breaks,recompiles,perf_hints"
  [cudag_keep]="TORCH_LOGS=graph_breaks,recompiles,perf_hints"
  [cudag_gath]="TORCH_LOGS=graph_breaks,recompiles,perf_hints"
  [cudag_gath_notrees]="TORCH_LOGS=graph_breaks,recompiles,perf_hints"
)
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=(recipe r16_rowbound amb08_16k nob16k amb07_32k padded)
for name in "${NAMES[@]}"; do
  prefix=""
  [ "$name" = old ] && prefix="$ROOT/.bench_old:"
  # shellcheck disable=SC2086
  variant "$name" "${LIMIT:-150}" "$prefix" ${ARGS[$name]}
done

echo "== summary" | tee -a "$LOG"
python3 - "$OUT/results.jsonl" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
print(f"{'variant':10} {'update s':>9} {'tok/s':>8} {'MFU':>6} {'peak GiB':>8}  device busy / wall")
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "error" in r:
        print(f"{r['label']:10} failed: {r['error']}")
        continue
    p = r.get("profile") or {}
    busy = f"{p['device_busy_s']:.3f} / {p['profiled_wall_s']:.3f}" if "device_busy_s" in p else ""
    mfu, peak = r.get("mfu") or 0.0, r.get("peak_mem_gib") or 0.0
    print(f"{r['label']:10} {r['update_s']:9.3f} {r['trained_tokens_per_s']:8.0f} "
          f"{mfu:6.1%} {peak:8.2f}  {busy}")
EOF
