#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian machine (run as root) for egressd, for what it is set up for:
#
#   bash scripts/setup.sh [demo|test|gateway|bench]...   (default: test)
#
#   demo     curl, Python >= 3.12 (3.12 when there is one) in .venv, egressd (scripts/demo.sh)
#   gateway  demo's, plus Docker, docker-compose and mmdebstrap, and the gateway's images
#   bench    demo's, plus wrk and a C compiler (bench/run.py installs the rest it compares)
#   test     everything the test suite needs: every system package below, Python 3.12 with the
#            test extras, the npm packages the tests run, the gateway's images
#
# Safe to re-run: it only touches apt when a package is missing and the venv only when pyproject.toml
# or the extras changed.
set -euo pipefail

cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
REPO="$(pwd)"
VENV="$REPO/.venv"

PURPOSES=("$@")
((${#PURPOSES[@]})) || PURPOSES=(test)
for purpose in "${PURPOSES[@]}"; do
  case "$purpose" in
    demo | test | gateway | bench) ;;
    *)
      printf 'setup: unknown purpose %q (demo, test, gateway or bench)\n' "$purpose" >&2
      exit 2
      ;;
  esac
done
wants() { [[ " ${PURPOSES[*]} " == *" $1 "* ]]; }

# System packages: "package" or "package:command" (skip the package when the command already exists,
# e.g. npm ships inside NodeSource's nodejs and Debian's npm package would conflict with it).
DEMO_PACKAGES=(curl ca-certificates)
GATEWAY_PACKAGES=(
  docker.io:dockerd  # the compose gateway (docker-compose.yml)
  docker-compose
  mmdebstrap  # the gateway's base image, made from Debian packages (no image registry)
)
BENCH_PACKAGES=(wrk gcc:gcc libc6-dev)
TEST_PACKAGES=(
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
  "${GATEWAY_PACKAGES[@]}"
  logrotate:logrotate  # tests: the audit log rotated by docs/audit.md's logrotate example
  tinyscheme  # tests: every generated Seatbelt profile evaluated by a real Scheme reader
  acl:setfacl  # scripts/test_unprivileged.sh: the test user reaches the checkout and the interpreter
)
APT_PACKAGES=("${DEMO_PACKAGES[@]}")
wants gateway && APT_PACKAGES+=("${GATEWAY_PACKAGES[@]}")
wants bench && APT_PACKAGES+=("${BENCH_PACKAGES[@]}")
wants test && APT_PACKAGES+=("${TEST_PACKAGES[@]}")

log() { printf 'setup: %s\n' "$*" >&2; }

# The venv's interpreter: Python 3.12 for the test suite (what CI runs); for the other purposes a
# newer one does too (Debian 13's python3 is 3.13), installed from Debian when no 3.12 is found.
minor() { "$1" -c 'import sys; print(sys.version_info[1] if sys.version_info[0] == 3 else 0)' 2>/dev/null; }
if wants test; then MINORS="12"; else MINORS="12 13 14"; fi
venv_ok() {
  [[ -x "$VENV/bin/python" ]] && [[ " $MINORS " == *" $(minor "$VENV/bin/python") "* ]]
}

find_python() {
  local py v
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    command -v python3.12 && return 0
  fi
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -V -r); do
      py="$(PYENV_VERSION="$v" pyenv which python3 2>/dev/null)" && [[ -x "$py" ]] && echo "$py" && return 0
    done
  fi
  for py in "$HOME"/.pyenv/versions/3.12*/bin/python3; do
    [[ -x "$py" ]] && echo "$py" && return 0
  done
  wants test && return 1
  for py in python3.14 python3.13 python3; do
    if command -v "$py" >/dev/null 2>&1 && [[ " $MINORS " == *" $(minor "$py") "* ]] \
      && "$py" -c 'import venv, ensurepip' >/dev/null 2>&1; then
      command -v "$py" && return 0
    fi
  done
  return 1
}

debian_python_fits() {
  # Debian's python3 is new enough (Debian 13's 3.13; not Debian 12's 3.11): install it with venv.
  local version
  version="$(apt-cache policy python3 2>/dev/null | sed -n 's/^ *Candidate: \([0-9]*\.[0-9]*\).*/\1/p')"
  [[ " $MINORS " == *" ${version#3.} "* ]]
}

need_python=0
if ! wants test && ! venv_ok && ! find_python >/dev/null; then
  need_python=1
fi

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

if ((${#missing[@]} + need_python)); then
  if [[ "$(id -u)" != 0 ]]; then
    log "missing system packages: ${missing[*]:-python3 >= 3.12} (run this script as root to install them)"
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  if ((need_python)) && debian_python_fits; then
    missing+=(python3 python3-venv)
  fi
  if ((${#missing[@]})); then
    log "installing: ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null
  fi
fi

if ! venv_ok; then
  rm -rf "$VENV"
  python="$(find_python)" || python=""
  # no pip in it: uv installs (below), and pip too where a purpose needs it
  if [[ -z "$python" ]] || ! "$python" -m venv --without-pip "$VENV" || ! venv_ok; then
    log "ERROR: no Python 3.12 found (tried python3.12, pyenv 3.12.x, ~/.pyenv/versions/3.12*)."
    log "Install Python 3.12 (e.g. 'pyenv install 3.12') and re-run."
    exit 1
  fi
  log "created $VENV with $("$VENV/bin/python" -V)"
fi

# uv installs the packages (parallel downloads, no bytecode unless asked): pip alone takes most of
# a first run's time. It comes from PATH, or once into .cache/ with the first pip at hand; it trusts
# the system's certificates, as pip does (a registry mirror behind a local CA keeps working).
UV_VERSION=0.13.8
uv_tool() {
  local dir="$REPO/.cache/uv-$UV_VERSION" base boot="$REPO/.cache/uv-boot"
  if command -v uv >/dev/null 2>&1; then
    command -v uv
    return 0
  fi
  if [[ ! -x "$dir/bin/uv" ]]; then
    mkdir -p "$REPO/.cache"
    base="$("$VENV/bin/python" -c 'import sys; print(sys._base_executable)')"
    if ! "$base" -m pip --version >/dev/null 2>&1; then
      rm -rf "$boot" && "$base" -m venv "$boot" && base="$boot/bin/python"
    fi
    if ! "$base" -m pip install -q --disable-pip-version-check --root-user-action=ignore --target "$dir" \
      "uv==$UV_VERSION" >"$boot.log" 2>&1; then
      cat "$boot.log" >&2
      return 1
    fi
    rm -rf "$boot" "$boot.log"
  fi
  echo "$dir/bin/uv"
}

# Editable install (with the test extras for `test`), only when pyproject.toml or the extras changed.
target="."
wants test && target=".[test]"
stamp="$VENV/.egressd-install-stamp"
sources="$(sha256sum pyproject.toml setup.py | sha256sum | cut -d' ' -f1)"
want="$sources $target"
have="$(cat "$stamp" 2>/dev/null || true)"
[[ "$have" == "$sources .[test]" ]] && want="$have"  # the test extras hold everything the rest needs
# pip in the venv for what runs it (the gateway's image build, bench, the wheel test); bytecode for
# `test`, whose egressd processes run with PYTHONDONTWRITEBYTECODE and would otherwise compile their
# dependencies on every start
extra=()
wants demo && ((${#PURPOSES[@]} == 1)) || extra+=(pip)
wants test && extra+=(--compile-bytecode)
if [[ "$have" != "$want" ]] \
  || ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("egressd")' 2>/dev/null \
  || { [[ " ${extra[*]} " == *" pip "* ]] && ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; }; then
  log "installing egressd (editable: $target) into $VENV"
  install_log="$VENV/install.log"
  if ! uv="$(uv_tool)" \
    || ! UV_LINK_MODE=copy UV_NATIVE_TLS="${UV_NATIVE_TLS:-1}" UV_PYTHON_DOWNLOADS=never \
      "$uv" pip install -q --python "$VENV/bin/python" -e "$target" "${extra[@]}" >"$install_log" 2>&1; then
    cat "$install_log" >&2 2>/dev/null || true
    log "ERROR: installing egressd's packages failed (log: $install_log)"
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
if wants test; then
  # tests/e2e/test_mcp.py: a real npm MCP server.
  npm_into mcp-npm @modelcontextprotocol/server-everything@2026.8.31
  # tests/component/test_export_istio.py: the models of Istio's CRDs and of Kubernetes, with their validation.
  npm_into kube-models @kubernetes-models/istio@3.0.1 kubernetes-models@5.1.0
fi
# The compose gateway (docker-compose.yml) and its tests: the images, built here from Debian packages
# and a local wheelhouse (no registry), cached by recipe hash (seconds when nothing changed). The tests
# rebuild egressd's image offline when its source changed.
if (wants test || wants gateway) && ! "$VENV/bin/python" scripts/gateway_image.py >/dev/null; then
  log "ERROR: the gateway's images could not be built (scripts/gateway_image.py)"
  exit 1
fi
log "ok: ${PURPOSES[*]} ($("$VENV/bin/python" -V))"
