#!/usr/bin/env bash
# `make gpu-check`: the GPU check on a bare CUDA machine (a CUDA torch, no network). Installs the
# wheels `make gpu-wheels` put in .whl/ without an index, into a folder of their own that shadows the
# image's older copies, then runs scripts/gpu_check.py (report in $OUT, else runs/gpu-check).
#
#     bash scripts/gpu_check.sh [gpu_check.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "error: no CUDA device is visible to torch here; the GPU check runs on a GPU machine" >&2
  exit 2
fi
site=${DRAFTSMITH_GPU_SITE:-/tmp/draftsmith-gpu-site}
if compgen -G ".whl/*.whl" >/dev/null; then
  python -m pip install --quiet --no-index --no-deps --target "$site" .whl/*.whl
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "note: no .whl/ here (run 'make gpu-wheels' where the registries are); using what the image has" >&2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
exec python scripts/gpu_check.py "$@"
