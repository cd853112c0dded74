#!/usr/bin/env bash
# Lint, format and type checks (what .ci/run runs before the tests, and pre-commit runs on commit).
set -euo pipefail
cd "$(dirname "$0")/.."
# pinned: a new release's rules would turn a green tree red without a change in it
if ! python -c "import importlib.metadata as m; assert m.version('ruff') == '0.17.6' and m.version('mypy') == '2.4.1'" 2>/dev/null; then
    echo "lint: installing ruff 0.17.6 and mypy 2.4.1" >&2
    python -m pip install --quiet ruff==0.17.6 mypy==2.4.1
fi
python -m ruff check .
python -m ruff format --check .
# the cache in k3train's cache directory: a fresh clone (CI) reuses it
python -m mypy --cache-dir "${K3TRAIN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/k3train}/mypy"
