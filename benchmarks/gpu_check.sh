#!/usr/bin/env bash
# The CUDA path on a GPU machine, in one go (issue 21). Parts (default: all, in this order):
#   throughput  the trainer's tokens/s against a plain torch loop, with MFU (`small`, bf16)
#   tests       tests/integration/test_cuda.py: SIGKILL and resume, two daemons exchanging,
#               the status view's GPU fields, decoding and digests on the GPU (TESTS: a -k filter)
#   round_end   how long a round's end holds the trainer (`small`, two daemons; PROTOCOLS, default
#               noloco,dilocox)
#   beside      the same for DiLoCoX with its round end beside training
#   memory      device and host memory per node, part by part (tiny, small, medium)
#   profile     where a NoLoCo round's end and a partner's correction spend their time: the
#               simulator (the daemon's round code) under cProfile, every kernel synchronous
# Results go to the folder given (default gpu-check/): JSON, logs, profiles.
#   bash benchmarks/gpu_check.sh [OUT_DIR [PART ...]]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
shift || true
parts=${*:-throughput tests round_end beside memory profile}
mkdir -p "$out"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
"$PY" -c "import torch, hivemind, node.cli; print('torch', torch.__version__, 'hivemind', hivemind.__version__)" \
  | tee -a "$out/device.txt"
SMALL=(--config configs/train-tiny.toml --set model.preset=small --set model.vocab_size=32000
       --set data.seq_len=1024 --set train.micro_batch_size=16 --set train.tokens_per_step=16384)
for part in $parts; do
  echo "== $part ($(date +%T))"
  case $part in
    throughput) timeout 120 "$PY" benchmarks/trainer_throughput.py --device cuda --threads 8 --blocks 5 \
                  --steps 20 "${SMALL[@]}" --json "$out/throughput.json" 2>&1 | tee "$out/throughput.log" ;;
    tests) timeout 200 "$PY" -m pytest -q -s -rA -p no:cacheprovider tests/integration/test_cuda.py \
             ${TESTS:+-k "$TESTS"} 2>&1 | tee "$out/tests.log" ;;
    round_end) timeout 200 "$PY" benchmarks/round_end.py --model small --device cuda --timeout 150 \
                 --protocols "${PROTOCOLS:-noloco,dilocox}" --json "$out/round_end.json" 2>&1 | tee "$out/round_end.log" ;;
    beside) timeout 200 "$PY" benchmarks/round_end.py --model small --device cuda --timeout 150 \
              --protocols dilocox --beside --json "$out/round_end_beside.json" 2>&1 | tee "$out/round_end_beside.log" ;;
    memory) timeout 300 "$PY" benchmarks/node_memory.py --device cuda --batch 8 --seq-len 1024 \
              --models tiny small medium --computed large --json "$out/node_memory_cuda.json" 2>&1 \
              | tee "$out/memory.log" ;;
    profile) CUDA_LAUNCH_BLOCKING=1 timeout 150 "$PY" -m cProfile -o "$out/noloco.prof" -m node.cli simulate \
               --protocol noloco --workers 2 -H 10 --rounds 4 --eval-every 100 --latency-steps 3 \
               "${SMALL[@]}" --set train.device=cuda --out "$out/simulate" > "$out/profile.log" 2>&1
             "$PY" -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(
               'rounds/noloco|protocol/|contributions|wire_tensors|trainer', 45)" "$out/noloco.prof" \
               | tee "$out/profile.txt" ;;
    *) echo "unknown part: $part" >&2 ;;
  esac
done
echo "== done ($(date +%T))"
