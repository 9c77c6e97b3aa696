#!/usr/bin/env bash
# The checks that need a GPU, in one run on a machine with CUDA, each step under its own time
# limit so one hang cannot eat the rest:
#   1. the GPU-marked tests (`pytest -m gpu`: the CUDA worker, CUDA graphs, Triton's compiled
#      attention, the sampler on device, `LLM` end to end against transformers on the GPU);
#   2. scripts/bench_throughput.py on CUDA (v1engine, v1engine without CUDA graphs and
#      transformers in one alternating run): the 64-request workload in bfloat16 and float32,
#      and batch-1 decode (128-token prompt, 256 outputs) in bfloat16.
# The benchmarks run on a checkpoint of the default model's shape: give its directory (config
# and tokenizer files; weights are drawn at random when it has none, which does not change the
# speed of a run that ignores EOS).
#
#   bash scripts/cuda_checks.sh OUT_DIR [MODEL_DIR]
#
# Logs and JSON results go to OUT_DIR. PYTHON picks the interpreter (default python3); CHECKS
# picks the steps (default "tests bench"; the benchmarks need MODEL_DIR).
set -u
out=${1:?usage: cuda_checks.sh OUT_DIR [MODEL_DIR]}
model=${2:-}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() { echo "=== $(date +%T) $*"; }

step "environment"
nvidia-smi -L || exit 1
$py -c "import torch, xgrammar, zmq, msgspec, fastapi, openai, v1engine
from importlib.metadata import version
print('cuda', torch.version.cuda, *(f'{n} {version(n)}' for n in ('torch', 'triton', 'transformers', 'xgrammar')))
assert torch.cuda.is_available(), 'torch sees no GPU'" || exit 1

checks=${CHECKS:-tests bench}
if [[ $checks == *tests* ]]; then
    step "GPU tests"
    timeout 300 $py -m pytest -m gpu -n 0 -p no:cacheprovider -q -rfEs --timeout 150 tests \
        2>&1 | tee "$out/gpu_tests.log"
fi

[[ $checks == *bench* && -n $model ]] || exit 0
step "benchmark checkpoint"
if ! ls "$model"/*.safetensors >/dev/null 2>&1; then
    timeout 120 $py -c "import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
config = AutoConfig.from_pretrained(sys.argv[1])
AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(sys.argv[1])
" "$model" || exit 1
fi

bench() {  # NAME ARGS...: one bench_throughput run, its log and JSON under $out
    local name=$1
    shift
    step "benchmark $name"
    timeout 150 $py scripts/bench_throughput.py --device cuda --model "$model" --eager-baseline \
        --kv-cache-gib 4 --repeats 3 --json "$out/$name.json" "$@" 2>&1 | tee "$out/$name.log"
}
bench throughput_bf16 --dtype bfloat16
bench decode_b1_bf16 --dtype bfloat16 --num-requests 1 --min-prompt-len 128 \
    --max-prompt-len 128 --min-output-len 256 --max-output-len 256
bench throughput_fp32 --dtype float32
step "done"
