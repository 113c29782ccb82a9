#!/usr/bin/env bash
# The README's first command: set up what the demo needs (idempotent), then show egressd allowing a
# loopback server and refusing blocked.example with a reason. Exit 0 when both are as expected.
set -euo pipefail
cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
bash scripts/setup.sh demo
exec .venv/bin/python scripts/demo.py "$@"
