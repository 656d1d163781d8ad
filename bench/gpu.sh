#!/usr/bin/env bash
# GPU readiness, in one short run (well under 10 minutes on one GPU): host tier
# <-> GPU bandwidth next to a raw pinned copy, the cuda-marked tests (the engine
# on the GPU among them), then the TTFT bench with the engine on the GPU.
# Run from the repository root after `make setup` (or `make test`); PYTHON=python3
# runs it with an interpreter that already holds kvtier's dependencies instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-${VENV:-.venv}/bin/python}
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
mkdir -p bench/results
# The copy figures first: they need no model file, and a failing test below must not cost them.
"$PYTHON" -m kvtier.cli bench gpu --json | tee bench/results/gpu-latest.json
"$PYTHON" -m pytest -q -m cuda tests
KVTIER_ENGINE__DEVICE=cuda "$PYTHON" -m kvtier.cli bench ttft --json --tokens 4096 --reps 3 | tee bench/results/ttft-gpu-latest.json
