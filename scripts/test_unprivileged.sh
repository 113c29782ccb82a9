#!/usr/bin/env bash
# The confinement tests again, as an ordinary user with a home of its own. Run as root (CI runs it
# after the root run; scripts/test.sh calls it). Users are not root: a sandbox, exec, ssh or agent
# host path that only works for root must fail here. Tests that truly need root carry
# @pytest.mark.needs_root("why") and are deselected here (the root run runs them).
#
# The user's home holds the secrets a careless sandbox would show (an SSH key, cloud and registry
# credentials, shell history, an API key file); they are fakes, marked as such.
# Exit code: pytest's (5, "no tests collected", counts as a failure).
set -euo pipefail

cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
REPO="$(pwd)"

# The one list of what runs as the ordinary user: the sandbox, exec, ssh and agent-host modules,
# and the unit tests of the sandbox's parts.
MODULES=(
  tests/e2e/test_sandbox_capture.py
  tests/security/test_sandbox_escapes.py
  tests/e2e/test_sandbox_home.py
  tests/e2e/test_sandbox_hooks.py
  tests/component/test_seatbelt_run.py
  tests/e2e/test_sandbox_host_services.py
  tests/e2e/test_sandbox_integration.py
  tests/unit/test_sandbox_narrow.py
  tests/component/test_sandbox_own_files.py
  tests/e2e/test_sandbox_ssh.py
  tests/security/test_sandbox_syscalls.py
  tests/e2e/test_sandbox_workloads.py
  tests/e2e/test_sandbox_startup.py
  tests/e2e/test_exec_integration.py
  tests/e2e/test_exec_capture.py
  tests/e2e/test_exec_compat.py
  tests/e2e/test_exec_startup.py
  tests/e2e/test_refusal_hints.py
  tests/e2e/test_attach.py
  tests/e2e/test_identity.py
  tests/e2e/test_ssh_cli.py
  tests/component/test_ssh_guard.py
  tests/e2e/test_ssh_integration.py
  tests/e2e/test_acp.py
  tests/e2e/test_mcp.py
  tests/unit/test_bwrap_argv.py
  tests/component/test_capture_units.py
  tests/component/test_seccomp.py
  tests/unit/test_shields.py
  tests/component/test_ssh_args.py
  tests/component/test_project_hooks.py
  tests/component/test_identity_units.py
  tests/component/test_peer.py
)
TEST_USER="${EGRESSD_TEST_USER:-egressd-tester}"
# Fakes of what a real home holds; each file's text names itself, so a test can look for it.
SECRETS=(
  .ssh/id_ed25519
  .aws/credentials
  .bash_history
  .zsh_history
  .netrc
  .git-credentials
  .npmrc
  .pypirc
  .pgpass
  .docker/config.json
  .kube/config
  .config/gh/hosts.yml
  .config/keys/anthropic
)

log() { printf 'test_unprivileged: %s\n' "$*" >&2; }

if [[ "$(id -u)" != 0 ]]; then
  log "run as root (it creates the user $TEST_USER); as an ordinary user, run:"
  log "  .venv/bin/pytest -m 'not needs_root' ${MODULES[*]}"
  exit 1
fi

if ! id -u "$TEST_USER" >/dev/null 2>&1; then
  useradd --create-home --user-group --shell /bin/bash "$TEST_USER"
fi
HOME_DIR="$(getent passwd "$TEST_USER" | cut -d: -f6)"
for relative in "${SECRETS[@]}"; do
  path="$HOME_DIR/$relative"
  if [[ ! -f "$path" ]]; then
    runuser -u "$TEST_USER" -- mkdir -p -m 700 "$(dirname "$path")"
    printf 'egressd-test-secret %s (a fake: must never be readable inside a sandbox)\n' "$relative" |
      runuser -u "$TEST_USER" -- sh -c "umask 077; cat > '$path'"
  fi
done

as_user() { runuser -u "$TEST_USER" -- "$@"; }

# The user must reach the checkout and the interpreter the venv was made from (often under root's
# own home), and read them; nothing more is opened: one ACL entry per directory that blocks it.
reach() {
  local target="$1" prefix="" part
  IFS=/ read -r -a parts <<<"${target#/}"
  for part in "${parts[@]}"; do
    prefix="$prefix/$part"
    if ! as_user test -x "$prefix"; then
      setfacl -m "u:$TEST_USER:x" "$prefix"
    fi
  done
  if ! as_user test -r "$target"; then
    setfacl -R -m "u:$TEST_USER:rX" "$target"
  fi
}
BASE_PREFIX="$(.venv/bin/python -c 'import os, sys; print(os.path.realpath(sys.base_prefix))')"
reach "$REPO"
reach "$BASE_PREFIX"
if ! as_user "$REPO/.venv/bin/python" -c 'import egressd, mitmproxy' 2>/dev/null; then
  log "ERROR: $TEST_USER cannot import egressd from $REPO/.venv"
  exit 1
fi

rc=0
# an ordinary user's environment, nothing of root's (its TMPDIR, XDG_RUNTIME_DIR, agent sockets)
as_user env -i \
  HOME="$HOME_DIR" USER="$TEST_USER" LOGNAME="$TEST_USER" SHELL=/bin/bash \
  PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 CI="${CI:-}" \
  "$REPO/.venv/bin/pytest" -p no:cacheprovider -m "not needs_root" "$@" "${MODULES[@]}" || rc=$?
if [[ "$rc" == 5 ]]; then
  log "pytest collected no tests as $TEST_USER — treating as a failure"
  exit 1
fi
exit "$rc"
