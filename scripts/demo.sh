#!/usr/bin/env bash
# The README's first command: set up this machine (idempotent), then show egressd allowing a
# loopback server and refusing blocked.example with a reason. Exit 0 when both are as expected.
set -euo pipefail
cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
bash scripts/setup.sh
exec .venv/bin/python -m egressd.demo "$@"
