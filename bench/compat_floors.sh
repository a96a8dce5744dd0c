#!/usr/bin/env bash
# The declared dependency floors, tested once: a fresh venv with the oldest versions pyproject.toml allows
# (torch, safetensors, click, rich at their floors; Python at its floor), ckptfix installed without its
# dependencies resolved by pip, then the fast test tier. Usage: bash bench/compat_floors.sh [PYTHON]
# The result of the last run is in README.md (Installation: what is tested).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3.11}
VENV=$(mktemp -d /tmp/ckptfix-floors.XXXXXX)
trap 'rm -rf "$VENV"' EXIT
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 "safetensors==0.4.0" "click==8.2.0" "rich==13.0.0"
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/pip" install -q "pytest>=8" "hypothesis>=6.100" "numpy>=1.26"  # test tools, not runtime floors
"$VENV/bin/python" -c "import sys, torch, safetensors, click, rich; print('floors:', sys.version.split()[0], \
'torch', torch.__version__, 'safetensors', safetensors.__version__, 'click', click.__version__)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider
