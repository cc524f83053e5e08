#!/usr/bin/env bash
# The CUDA path on a GPU machine, in one go. Parts (default: the first four, under 8 minutes on
# an H100/H200; each part's own timeout bounds it):
#   speed       `small`'s tokens/s and MFU: the trainer compiled and eager against a compiled
#               plain torch loop, in the card's own precision (bf16 on an H100)
#   fp16        the same trainer and plain loop, compiled, in fp16 with loss scaling (the path
#               of cards without bf16) on this card
#   probe       the micro-batch the trainer's probe finds (of 128 sequences of 1024 a step), the
#               probe's and training's peak memory, and tokens/s at that size, compiled
#   exchange    two `join` daemons, compile on, exchanging for 3 rounds of 20 steps (NoLoCo)
# and, by name, the earlier checks:
#   throughput  the trainer's tokens/s against a plain torch loop, eager, with MFU
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
parts=${*:-speed fp16 probe exchange}
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
    speed) timeout 170 "$PY" benchmarks/trainer_throughput.py --device cuda --threads 8 --blocks 3 \
             --steps 20 "${SMALL[@]}" --loops ours,ours-compiled,plain-compiled \
             --json "$out/speed.json" 2>&1 | tee "$out/speed.log" ;;
    fp16) timeout 120 "$PY" benchmarks/trainer_throughput.py --device cuda --threads 8 --blocks 3 \
            --steps 20 "${SMALL[@]}" --precision fp16 --loops ours-compiled,plain-compiled \
            --json "$out/fp16.json" 2>&1 | tee "$out/fp16.log" ;;
    probe) timeout 60 "$PY" benchmarks/device_fit.py --device cuda --compile on --steps 5 "${SMALL[@]}" \
             --set train.tokens_per_step=131072 --json "$out/probe.json" 2>&1 | tee "$out/probe.log" ;;
    exchange) timeout 140 "$PY" benchmarks/round_end.py --model small --device cuda --timeout 120 \
                --compile on --protocols noloco --inner-steps 20 --steps 60 \
                --json "$out/exchange.json" 2>&1 | tee "$out/exchange.log" ;;
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
# every part's JSON in one file, keyed by its name (a part that failed is absent)
"$PY" -c "import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
parts = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob('*.json')) if p.stem != 'summary'}
(out / 'summary.json').write_text(json.dumps({'device': (out / 'device.txt').read_text(), **parts}, indent=2))
print('wrote', out / 'summary.json', 'with', ', '.join(parts) or 'no part')" "$out"
echo "== done ($(date +%T))"
