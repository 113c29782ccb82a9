#!/bin/sh
# Run a command with the proxy variables pointing at the egressd gateway. The credentials are the
# ones egressd-init created for this client: NAME from $EGRESSD_CLIENT, the token from a file in the
# read-only clients volume. The CA bundle (system roots + egressd's CA) is trusted when present: it
# verifies the gateway's TLS port (https:// proxy URL) and inspected hosts. Without a command: idle
# until stopped (so `docker-compose exec` has somewhere to run).
set -eu
name="${EGRESSD_CLIENT:-agent}"
dir="${EGRESSD_CLIENT_DIR:-/run/egressd}"
gateway="${EGRESSD_GATEWAY:-egressd:3128}"
if [ -r "$dir/$name.token" ]; then
  proxy="${EGRESSD_GATEWAY_SCHEME:-https}://$name:$(cat "$dir/$name.token")@$gateway"
  export HTTP_PROXY="$proxy" HTTPS_PROXY="$proxy" http_proxy="$proxy" https_proxy="$proxy"
fi
if [ -r "$dir/ca-bundle.pem" ]; then
  export SSL_CERT_FILE="$dir/ca-bundle.pem" CURL_CA_BUNDLE="$dir/ca-bundle.pem" \
    REQUESTS_CA_BUNDLE="$dir/ca-bundle.pem" NODE_EXTRA_CA_CERTS="$dir/ca-bundle.pem" \
    GIT_PROXY_SSL_CAINFO="$dir/ca-bundle.pem"
  # curl verifies an https:// proxy with --proxy-cacert only (no variable): a curlrc that says it
  CURL_HOME="$(mktemp -d)"
  printf 'proxy-cacert = "%s"\n' "$dir/ca-bundle.pem" >"$CURL_HOME/.curlrc"
  export CURL_HOME
fi
if [ "$#" -eq 0 ] || [ "$1" = idle ]; then
  trap 'exit 0' TERM INT
  sleep infinity &
  wait
  exit 0
fi
exec "$@"
