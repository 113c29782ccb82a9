#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian machine (run as root) for egressd: system packages, the
# Python 3.12 venv in .venv and an editable install with the test extras. Safe to re-run: it only
# touches apt when a package is missing and pip only when pyproject.toml changed.
set -euo pipefail

cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
REPO="$(pwd)"
VENV="$REPO/.venv"

# System packages: "package" or "package:command" (skip the package when the command already exists,
# e.g. npm ships inside NodeSource's nodejs and Debian's npm package would conflict with it).
APT_PACKAGES=(
  curl
  wget:wget  # tests: wget through an inspected tunnel (it reads a wgetrc, not SSL_CERT_FILE)
  nodejs:node
  npm:npm
  git
  iproute2:ip
  ca-certificates
  bubblewrap:bwrap
  nftables:nft  # the sandbox's capture of connections that ignore the proxy variables
  openjdk-17-jdk-headless:javac  # tests: Java's HttpClient inside the sandbox
  golang-go:go  # tests: a Go client whose transport ignores the environment
  openssh-client:ssh
  openssh-server:sshd
  wrk
  libc6-dev
  squid  # tests: the exported squid.conf, loaded and served by Debian's squid
  chromium  # tests: the dashboard in a real headless browser (Playwright drives /usr/bin/chromium)
  docker.io:dockerd  # the compose gateway (docker-compose.yml), tested on a real engine
  docker-compose
  mmdebstrap  # the gateway's base image, made from Debian packages (no image registry)
  logrotate:logrotate  # tests: the audit log rotated by docs/audit.md's logrotate example
  tinyscheme  # tests: every generated Seatbelt profile evaluated by a real Scheme reader
)

log() { printf 'setup: %s\n' "$*" >&2; }

missing=()
for entry in "${APT_PACKAGES[@]}"; do
  pkg="${entry%%:*}"
  cmd=""
  [[ "$entry" == *:* ]] && cmd="${entry#*:}"
  if [[ -n "$cmd" ]] && command -v "$cmd" >/dev/null 2>&1; then
    continue
  fi
  if dpkg -s "$pkg" 2>/dev/null | grep -q '^Status: install ok installed'; then
    continue
  fi
  missing+=("$pkg")
done

if ((${#missing[@]})); then
  if [[ "$(id -u)" != 0 ]]; then
    log "missing system packages: ${missing[*]} (run this script as root to install them)"
    exit 1
  fi
  log "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null
fi

# Python 3.12 interpreter for the venv.
venv_ok() {
  [[ -x "$VENV/bin/python" ]] &&
    "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null
}

make_venv() {
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import venv' >/dev/null 2>&1; then
    python3.12 -m venv "$VENV" && return 0
  fi
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -V -r); do
      PYENV_VERSION="$v" pyenv exec python3 -m venv "$VENV" && return 0
    done
  fi
  for py in "$HOME"/.pyenv/versions/3.12*/bin/python3; do
    [[ -x "$py" ]] && "$py" -m venv "$VENV" && return 0
  done
  return 1
}

if ! venv_ok; then
  log "creating $VENV with Python 3.12"
  rm -rf "$VENV"
  if ! make_venv || ! venv_ok; then
    log "ERROR: no Python 3.12 found (tried python3.12, pyenv 3.12.x, ~/.pyenv/versions/3.12*)."
    log "Install Python 3.12 (e.g. 'pyenv install 3.12') and re-run."
    exit 1
  fi
fi

# Editable install with test extras, only when pyproject.toml changed since the last install.
stamp="$VENV/.egressd-install-stamp"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]] \
  || ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("egressd")' 2>/dev/null; then
  log "installing egressd (editable, with test extras) into $VENV"
  pip_log="$VENV/pip-install.log"
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test]' >"$pip_log" 2>&1; then
    cat "$pip_log" >&2
    log "ERROR: pip install failed (log: $pip_log)"
    exit 1
  fi
  printf '%s\n' "$want" >"$stamp"
fi
# egressd's own bytecode, as a wheel install has it: with PYTHONDONTWRITEBYTECODE set, every egressd
# the tests start would otherwise compile its ~100 modules again (~0.4 s of CPU each time). A module
# edited later is recompiled from its source as usual (the .pyc records the source's mtime).
"$VENV/bin/python" -m compileall -q egressd addons >/dev/null
# npm packages the tests use, pinned, each set in its own folder under .cache/. Installed here, not by
# the tests: they run in network namespaces with no way to the registry.
npm_into() {
  local dir="$REPO/.cache/$1"
  shift
  if [[ "$(cat "$dir/.installed" 2>/dev/null)" != "$*" ]]; then
    log "installing $* into $dir"
    mkdir -p "$dir"
    if ! (cd "$dir" && npm install --no-audit --no-fund --silent --no-save "$@" >npm-install.log 2>&1); then
      cat "$dir/npm-install.log" >&2
      log "ERROR: npm install $* failed (log: $dir/npm-install.log)"
      exit 1
    fi
    printf '%s\n' "$*" >"$dir/.installed"
  fi
}
# tests/test_mcp.py: a real npm MCP server.
npm_into mcp-npm @modelcontextprotocol/server-everything@2026.8.31
# tests/test_export_istio.py: the models of Istio's CRDs and of Kubernetes, with their validation.
npm_into kube-models @kubernetes-models/istio@3.0.1 kubernetes-models@5.1.0
# The compose gateway (docker-compose.yml) and its tests: the images, built here from Debian packages
# and a local wheelhouse (no registry), cached by recipe hash (seconds when nothing changed). The tests
# rebuild egressd's image offline when its source changed.
if ! "$VENV/bin/python" scripts/gateway_image.py >/dev/null; then
  log "ERROR: the gateway's images could not be built (scripts/gateway_image.py)"
  exit 1
fi
log "ok ($("$VENV/bin/python" -V))"
