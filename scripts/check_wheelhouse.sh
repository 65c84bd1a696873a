#!/usr/bin/env bash
# The offline install of docs/gpu.md, checked on this machine: a wheelhouse for this machine's Python (`make
# wheelhouse`), a fresh venv holding torch and torchvision only (what a GPU node brings), the wheelhouse installed
# into it without a network (`unshare --net` where this user may, and pip's index and config turned off either way),
# `pip check`, then `python -m coarse2fine.gpu_check --cpu-dry-run` in that venv. It downloads about 500 MB and
# installs torch (7 GB with its CUDA libraries), so it is not part of the suite; it prints each part's time and
# removes everything it made (a temporary folder) at the end. Run from anywhere: scripts/check_wheelhouse.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=$(mktemp -d -t coarse2fine-wheelhouse-XXXXXX)
trap 'rm -rf "$scratch"' EXIT
python_version=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
pin() { grep -i "^$1==" requirements.lock; }
timed() {  # timed LABEL COMMAND...
  local label=$1 started=$SECONDS
  shift
  "$@"
  echo "check_wheelhouse: $label: $((SECONDS - started)) s" >&2
}
if unshare --net true 2>/dev/null; then offline=(unshare --net); else
  offline=(); echo "check_wheelhouse: unshare --net is not allowed here: offline by pip's options alone" >&2; fi
# No index, no find-links or constraints from this machine's pip configuration: the wheelhouse alone.
no_config=(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null)

venv=$scratch/venv
timed "make wheelhouse" make --no-print-directory wheelhouse PYTHON_VERSION="$python_version" \
  WHEELHOUSE="$scratch/wheelhouse"
du -sh "$scratch/wheelhouse" >&2
timed "a fresh venv" python3 -m venv "$venv"
# torch and torchvision as a GPU node brings them
timed "torch and torchvision into it" "$venv/bin/pip" install --quiet "$(pin torch)" "$(pin torchvision)"
timed "the wheelhouse into it, offline" "${offline[@]}" "${no_config[@]}" "$venv/bin/pip" install --quiet \
  --no-index --no-deps "$scratch"/wheelhouse/*.whl
timed "pip check" "${no_config[@]}" "$venv/bin/pip" check
timed "gpu_check --cpu-dry-run, offline" "${offline[@]}" env -u PYTHONPATH "$venv/bin/python" \
  -m coarse2fine.gpu_check --cpu-dry-run --out "$scratch/report"
cat "$scratch/report/report.md"
