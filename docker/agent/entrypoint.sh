#!/bin/sh
# Run a command with the proxy variables pointing at the egressd gateway. The credentials are the
# ones egressd-init created for this client: NAME from $EGRESSD_CLIENT, the token from a file in the
# read-only clients volume. The CA bundle (system roots + egressd's inspection CA) is trusted when
# present. Without a command: idle until stopped (so `docker-compose exec` has somewhere to run).
set -eu
name="${EGRESSD_CLIENT:-agent}"
dir="${EGRESSD_CLIENT_DIR:-/run/egressd}"
gateway="${EGRESSD_GATEWAY:-egressd:3128}"
if [ -r "$dir/$name.token" ]; then
  proxy="http://$name:$(cat "$dir/$name.token")@$gateway"
  export HTTP_PROXY="$proxy" HTTPS_PROXY="$proxy" http_proxy="$proxy" https_proxy="$proxy"
fi
if [ -r "$dir/ca-bundle.pem" ]; then
  export SSL_CERT_FILE="$dir/ca-bundle.pem" CURL_CA_BUNDLE="$dir/ca-bundle.pem" \
    REQUESTS_CA_BUNDLE="$dir/ca-bundle.pem" NODE_EXTRA_CA_CERTS="$dir/ca-bundle.pem"
fi
if [ "$#" -eq 0 ] || [ "$1" = idle ]; then
  trap 'exit 0' TERM INT
  sleep infinity &
  wait
  exit 0
fi
exec "$@"
