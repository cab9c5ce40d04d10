#!/usr/bin/env bash
# Single-GPU validation, end to end, in well under 10 minutes on an H200:
#   1. tests/gpu/gpu_checks.py: CUDA-IPC refit between two processes (bit-exact, GB/s
#      against a device-to-device copy), pack() throughput on device, JAX->torch dlpack.
#      The real IPCWeightSynchronizer, packed and direct (tests/gpu/ipc_sync.py).
#   2. pytest -m gpu tests/gpu (the same contracts as exact assertions, small sizes).
# Writes $OUT_DIR/gpu-summary.json and $OUT_DIR/gpu-table.md (OUT_DIR defaults to $OUT
# when set, as on the device machine, else out/gpu). Needs torch with CUDA; jax is
# optional (its check is skipped, with the reason, when absent). Downloads nothing:
# if anyio/pytest are missing on the machine, put wheels in .gpu-wheels/ beforehand
# (`pip download anyio sniffio pytest iniconfig pluggy packaging -d .gpu-wheels`).
#
# Usage: bash tests/gpu/run.sh [--quick]
set -uo pipefail

cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT_DIR=${OUT_DIR:-${OUT:-$ROOT/out/gpu}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
QUICK=()
[[ "${1:-}" == "--quick" ]] && QUICK=(--quick)

if [[ -d .gpu-wheels ]]; then
  "$PY" -m pip install -q --no-index --find-links .gpu-wheels anyio pytest 2>&1 | tail -2
fi
if ! "$PY" -c "import torch, anyio; assert torch.cuda.is_available(), 'no CUDA device'" ; then
  echo "run.sh: needs torch with a CUDA device and anyio (see the header)" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  > "$OUT_DIR/nvidia-smi.txt" 2>&1 || true

start=$(date +%s)
echo "== gpu_checks.py ${QUICK[*]:-}"
timeout 300 "$PY" tests/gpu/gpu_checks.py --json "${QUICK[@]}" 2>"$OUT_DIR/gpu-checks.stderr" \
  | tee "$OUT_DIR/gpu-checks.log"
checks_rc=${PIPESTATUS[0]}
tail -n 1 "$OUT_DIR/gpu-checks.log" > "$OUT_DIR/gpu-checks.json"

echo "== pytest -m gpu tests/gpu"
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout 300 "$PY" -m pytest -m gpu tests/gpu -q -p no:cacheprovider \
    -o addopts="" --import-mode=importlib --junitxml="$OUT_DIR/gpu-pytest.xml" 2>&1 | tee "$OUT_DIR/gpu-pytest.log"
  pytest_rc=${PIPESTATUS[0]}
else
  echo "pytest is not installed: skipped" | tee "$OUT_DIR/gpu-pytest.log"
  pytest_rc=-1
fi
elapsed=$(( $(date +%s) - start ))

"$PY" - "$OUT_DIR" "$checks_rc" "$pytest_rc" "$elapsed" <<'EOF'
import json, socket, sys, time
from pathlib import Path
import xml.etree.ElementTree as ET

out, checks_rc, pytest_rc, elapsed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
try:
    checks = json.loads((out / "gpu-checks.json").read_text())
except (OSError, ValueError):
    checks = None
tests = None
junit = out / "gpu-pytest.xml"
if junit.is_file():
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
summary = {
    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    "host": socket.gethostname(),
    "nvidia_smi": (out / "nvidia-smi.txt").read_text().strip() if (out / "nvidia-smi.txt").is_file() else "",
    "elapsed_s": elapsed,
    "gpu_checks_rc": checks_rc,
    "pytest_rc": pytest_rc,
    "pytest": tests,
    "checks": checks,
}
(out / "gpu-summary.json").write_text(json.dumps(summary, indent=2))
lines = [f"GPU validation {summary['date_utc']} UTC on {summary['nvidia_smi'] or summary['host']}", ""]
if checks:
    base = checks["d2d_copy_gbps"]
    ipc, pk, dl = checks["ipc_refit"], checks["pack"], checks["dlpack"]
    nccl = checks.get("nccl_two_ranks", {})
    lines += [
        f"Model manifest: {checks['model']} ({ipc['bytes'] / 1e9:.2f} GB), buckets of "
        f"{checks['bucket_bytes'] >> 20} MiB; torch {checks['torch']}, CUDA {checks['cuda']}",
        "",
        "| check | GB/s | vs D2D copy | result |",
        "|---|---:|---:|---|",
        f"| device-to-device copy (baseline) | {base:.1f} | 1.00 | |",
        f"| CUDA-IPC refit, 2 processes, warm | {ipc['gbps_warm']:.1f} | {ipc['ratio_vs_d2d']:.2f} | "
        f"{'bit-exact' if ipc['bit_exact'] else 'MISMATCH'} (cold {ipc['cold_s']:.3f} s) |",
        f"| pack() on device | {pk['gbps']:.1f} | {pk['ratio_vs_d2d']:.2f} | |",
        *(f"| IPCWeightSynchronizer {m}, AdamW between syncs | {checks['ipc_sync'][m]['gbps_warm']:.1f} | "
          f"{checks['ipc_sync'][m]['ratio_vs_d2d']:.2f} | "
          f"{'bit-exact' if checks['ipc_sync'][m]['bit_exact'] else 'MISMATCH'}, "
          f"{checks['ipc_sync'][m]['direct_buckets']} of {checks['ipc_sync'][m]['buckets']} buckets direct |"
          for m in ("packed", "direct") if "ipc_sync" in checks),
        *([f"| one copy_ per tensor (direct's bound) | {checks['ipc_sync']['per_tensor_copy_gbps']:.1f} | "
           f"{checks['ipc_sync']['per_tensor_copy_gbps'] / base:.2f} | direct at "
           f"{checks['ipc_sync']['direct_vs_per_tensor_copy']:.2f} of it |"] if "ipc_sync" in checks else []),
        f"| JAX->torch dlpack | | | {dl['status']}"
        + (f": zero-copy={dl['zero_copy']}, values equal={dl['values_equal']}" if dl['status'] == 'ok'
           else f": {dl.get('reason', '')}") + " |",
        (f"| NCCL collective refit, cuda:0 -> cuda:1 | {nccl['gbps_warm']:.1f} | "
         f"{nccl['gbps_warm'] / base:.2f} | {'bit-exact' if nccl['bit_exact'] else 'MISMATCH'} |")
        if "gbps_warm" in nccl else "| NCCL collective refit, two ranks | | | deferred: needs two GPUs |",
    ]
else:
    lines.append(f"gpu_checks.py failed (rc {checks_rc}); see gpu-checks.stderr")
if tests is not None:
    passed = tests["tests"] - tests["failures"] - tests["errors"] - tests["skipped"]
    lines += ["", f"pytest -m gpu: {passed} passed, {tests['failures'] + tests['errors']} failed, "
              f"{tests['skipped']} skipped"]
lines.append(f"Total {elapsed} s")
(out / "gpu-table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF

[[ $checks_rc -eq 0 && ( $pytest_rc -eq 0 || $pytest_rc -eq -1 ) ]]
