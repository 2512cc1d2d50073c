#!/usr/bin/env bash
# The CUDA path, on a machine with a GPU: the CUDA tests (tests/engine/test_cuda.py), then
# the benchmark's training and evaluation rows at C = 100 (K = 5, batch 32) and at the
# paper-scale shape (C = 10, K = 6, batch 10) on the GPU, then the paper-scale run
# evaluating every round against only the last. Each step has its own time limit, so that
# one that hangs leaves the others their time.
#
#   OUT=runs/cuda_check bash benchmarks/cuda_check.sh      # DEVICE=cuda:1 for another GPU
#
# Needs PyTorch with CUDA, numpy, pyyaml, tqdm, scikit-learn, pytest and hypothesis; runs
# from the source tree (PYTHONPATH=src), so no installation is needed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/cuda_check}
device=${DEVICE:-cuda}
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" \
    | tee "$out/device.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$out/device.txt"
timeout "${TEST_LIMIT:-240}" $py -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py \
    2>&1 | tee "$out/tests.txt"
rows=central_b32,central_big,peer_loop,splitfed_fedavg,splitfed_sflv1,splitfed_sflv2,splitfed_sl,splitfed_musplitfed
timeout "${BENCH_LIMIT:-100}" $py -m benchmarks.bench --device "$device" -C 100 -K 5 \
    --repeats 5 --threads 1 --variants "$rows" --out "$out/bench_c100.json" \
    2>&1 | tee "$out/bench_c100.txt"
timeout "${BENCH_LIMIT:-100}" $py -m benchmarks.bench --device "$device" -C 10 -K 6 \
    --batch 10 --repeats 5 --threads 1 --variants "$rows" --paper-run "${ROUNDS:-200}" \
    --out "$out/bench_paper.json" 2>&1 | tee "$out/bench_paper.txt"
