#!/usr/bin/env bash
# The torch releases ckptfix claims, tested: for each TORCH[:PYTHON] row, a venv with that torch, the other runtime
# dependencies at their pyproject.toml floors (safetensors, click, rich), ckptfix installed with --no-deps -e . (pip
# resolves nothing for it) and the test tools; then the fast test tier, and one table row:
#   | torch | python | passed/failed/skipped | date |
# Rows run one after another. The first row is the torch floor of pyproject.toml (README, "What is tested").
#
# Usage: bash bench/compat_floors.sh [TORCH[:PYTHON] ...]    (PYTHON defaults to python3.11, the Python floor)
#   default rows: 2.4.0 2.6.0 2.11.0:python3.12 2.13.0 2.14.1
# Venvs are kept for the next run in $CKPTFIX_COMPAT_DIR/TORCH-pyX.Y (default /tmp/ckptfix-compat), with each
# row's pytest output beside them (TORCH-pyX.Y.log); pip's own cache keeps re-installs cheap. Torch builds other
# than a local CPU wheel are the registry's CUDA builds (~3 GB with their nvidia-* libraries): they run on a CPU.
# On a shared machine: nice -n 10 bash bench/compat_floors.sh. Exit status 1 when any row has a failure or error.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=${CKPTFIX_COMPAT_DIR:-/tmp/ckptfix-compat}
ROWS=("$@")
[ ${#ROWS[@]} -gt 0 ] || ROWS=(2.4.0 2.6.0 2.11.0:python3.12 2.13.0 2.14.1)
# runtime floors as pyproject.toml declares them (torch is the row's own); test tools at any version
FLOORS=("safetensors==0.4.0" "click==8.2.0" "rich==13.0.0")
TOOLS=("pytest>=8" "hypothesis>=6.100" "numpy>=1.26")
mkdir -p "$DIR"

find_python() {  # a name on PATH that runs (pyenv shims may not), else a pyenv-installed one
    local name=$1 candidate
    if command -v "$name" >/dev/null && "$name" -c "" 2>/dev/null; then
        command -v "$name"
        return
    fi
    for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/*/bin/"$name"; do
        if [ -x "$candidate" ] && "$candidate" -c "" 2>/dev/null; then
            echo "$candidate"
            return
        fi
    done
    echo "compat_floors: no $name found (on PATH or under pyenv)" >&2
    return 1
}

count() {  # count WORD SUMMARY: the number before WORD in pytest's last line ("3 failed, 930 passed, ...")
    grep -oE "[0-9]+ $1" <<<"$2" | grep -oE "^[0-9]+" || echo 0
}

install() {  # install PYTHON VENV TORCH: the venv (kept from an earlier run if it is there), then every package
    local py=$1 venv=$2 version=$3  # (set -e does not hold inside `if install`: each step says if it failed)
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv" || return
    "$venv/bin/python" -m pip install -q "torch==$version" "${FLOORS[@]}" "${TOOLS[@]}" || return
    "$venv/bin/python" -m pip install -q --no-deps -e "$ROOT" || return
    "$venv/bin/python" -c "import sys, torch, safetensors, click, rich, importlib.metadata as m; \
print('installed: python', sys.version.split()[0], 'torch', torch.__version__, 'safetensors', \
safetensors.__version__, 'click', m.version('click'), 'rich', m.version('rich'))"
}

TABLE=()
STATUS=0
for row in "${ROWS[@]}"; do
    version=${row%%:*}
    pyname=python3.11
    [ "$row" = "$version" ] || pyname=${row#*:}
    if ! py=$(find_python "$pyname"); then
        STATUS=1
        TABLE+=("| $version | $pyname | no such python | $(date +%F) |")
        continue
    fi
    pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    venv=$DIR/$version-py$pyver
    log=$DIR/$version-py$pyver.log
    echo "== torch $version, python $pyver: $venv" >&2
    if ! install "$py" "$venv" "$version" >"$log" 2>&1; then
        STATUS=1
        tail -5 "$log" >&2
        TABLE+=("| $version | $pyver | install failed (see $log) | $(date +%F) |")
        continue
    fi
    tail -1 "$log" >&2
    rc=0
    "$venv/bin/python" -m pytest -q -p no:cacheprovider >>"$log" 2>&1 || rc=$?
    summary=$(grep -E "^=*[^=]* in [0-9.]+s" "$log" | tail -1)
    passed=$(count passed "$summary")
    failed=$(count failed "$summary")
    errors=$(count error "$summary")
    skipped=$(count skipped "$summary")
    result="$passed/$failed/$skipped"
    [ "$errors" = 0 ] || result="$result ($errors errors)"
    if [ "$rc" != 0 ] || [ -z "$summary" ]; then
        STATUS=1
        grep -E "^(FAILED|ERROR) " "$log" >&2 || tail -5 "$log" >&2
    fi
    TABLE+=("| $version | $pyver | $result | $(date +%F) |")
    echo "${TABLE[-1]}" >&2
done

echo "| torch | python | passed/failed/skipped | date |"
echo "|---|---|---|---|"
printf '%s\n' "${TABLE[@]}"
exit "$STATUS"
