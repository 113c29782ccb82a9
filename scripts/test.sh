#!/usr/bin/env bash
# Run the whole check: set-up (idempotent), ruff, then pytest with the given arguments.
# Both always run. Exit code: pytest's when it failed, else 1 if ruff failed, else 0.
# pytest's "no tests collected" (5) counts as a failure.
set -euo pipefail

cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."

bash scripts/setup.sh

lint_paths=()
for p in egressd addons tests; do
  [[ -e "$p" ]] && lint_paths+=("$p")
done
lint_rc=0
.venv/bin/ruff check "${lint_paths[@]}" || lint_rc=$?

rc=0
.venv/bin/pytest "$@" || rc=$?
if [[ "$rc" == 5 ]]; then
  echo "test.sh: pytest collected no tests — treating as a failure" >&2
  exit 1
fi
if [[ "$rc" != 0 ]]; then
  exit "$rc"
fi

if [[ "$lint_rc" != 0 ]]; then
  echo "test.sh: tests passed but ruff found problems (exit $lint_rc)" >&2
  exit 1
fi
exit 0
