#!/usr/bin/env bash
# Run the whole check: set-up (idempotent), ruff, pytest with the given arguments, then (as root)
# the confinement tests again as an ordinary user (scripts/test_unprivileged.sh). All always run.
# Exit code: the root run's pytest code when it failed, else the unprivileged run's, else 1 if ruff
# failed, else 0. pytest's "no tests collected" (5) counts as a failure.
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
  rc=1
fi

user_rc=0
if [[ "$(id -u)" == 0 ]]; then
  bash scripts/test_unprivileged.sh "$@" || user_rc=$?
fi
if [[ "$rc" != 0 ]]; then
  exit "$rc"
fi
if [[ "$user_rc" != 0 ]]; then
  echo "test.sh: the confinement tests failed as an ordinary user (exit $user_rc)" >&2
  exit "$user_rc"
fi

if [[ "$lint_rc" != 0 ]]; then
  echo "test.sh: tests passed but ruff found problems (exit $lint_rc)" >&2
  exit 1
fi
exit 0
