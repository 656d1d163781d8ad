#!/usr/bin/env bash
# GPU readiness, in one short run (well under 10 minutes on one GPU): the
# cuda-marked tests, the TTFT bench with the engine on the GPU (engine.device:
# auto picks it), then host tier <-> GPU bandwidth next to a raw pinned copy.
# Run from the repository root after `make setup` (or `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
"$VENV/bin/python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
"$VENV/bin/pytest" -q -m cuda tests
mkdir -p bench/results
KVTIER_ENGINE__DEVICE=cuda "$VENV/bin/kvtier" bench ttft --json --tokens 4096 --reps 3 | tee bench/results/ttft-gpu-latest.json
"$VENV/bin/kvtier" bench gpu --json | tee bench/results/gpu-latest.json
