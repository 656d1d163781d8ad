#!/usr/bin/env bash
# GPU readiness, in one short run (well under 10 minutes on one GPU): the
# cuda-marked tests (the engine on the GPU among them), the TTFT bench with the
# engine on the GPU, then host tier <-> GPU bandwidth next to a raw pinned copy.
# Run from the repository root after `make setup` (or `make test`); PYTHON=python3
# runs it with an interpreter that already holds kvtier's dependencies instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-${VENV:-.venv}/bin/python}
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
"$PYTHON" -m pytest -q -m cuda tests
mkdir -p bench/results
KVTIER_ENGINE__DEVICE=cuda "$PYTHON" -m kvtier.cli bench ttft --json --tokens 4096 --reps 3 | tee bench/results/ttft-gpu-latest.json
"$PYTHON" -m kvtier.cli bench gpu --json | tee bench/results/gpu-latest.json
