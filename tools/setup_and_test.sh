#!/usr/bin/env bash
# Set up a fresh machine and run the test suite (the README's second command).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_env.sh
exec python -m pytest tests "$@"
