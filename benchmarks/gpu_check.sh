#!/usr/bin/env bash
# The CUDA path on a GPU machine, in one go (issue 21): the trainer's tokens/s against a plain
# torch loop with MFU (`small`, bf16), the CUDA tests (SIGKILL and resume, two daemons exchanging,
# the status view's GPU fields), and how long a round's end holds the trainer (`small`, two
# daemons; DiLoCoX also with its round end beside training). Results go to the folder given
# (default gpu-check/): JSON and logs.
#   bash benchmarks/gpu_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
mkdir -p "$out"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
"$PY" -c "import torch, hivemind, node.cli; print('torch', torch.__version__, 'hivemind', hivemind.__version__)" \
  | tee -a "$out/device.txt"
SMALL=(--config configs/train-tiny.toml --set model.preset=small --set model.vocab_size=32000
       --set data.seq_len=1024 --set train.micro_batch_size=16 --set train.tokens_per_step=16384)
echo "== throughput"
timeout 120 "$PY" benchmarks/trainer_throughput.py --device cuda --threads 8 --blocks 5 --steps 20 \
  "${SMALL[@]}" --json "$out/throughput.json" 2>&1 | tee "$out/throughput.log"
echo "== tests"
timeout 200 "$PY" -m pytest -q -s -rA -p no:cacheprovider tests/integration/test_cuda.py 2>&1 \
  | tee "$out/tests.log"
echo "== round end"
timeout 200 "$PY" benchmarks/round_end.py --model small --device cuda --timeout 150 --json "$out/round_end.json" \
  2>&1 | tee "$out/round_end.log"
echo "== round end beside training (DiLoCoX)"
timeout 200 "$PY" benchmarks/round_end.py --model small --device cuda --timeout 150 --protocols dilocox \
  --beside --json "$out/round_end_beside.json" 2>&1 | tee "$out/round_end_beside.log"
