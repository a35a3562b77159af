#!/bin/sh
# Development CA, certificates, an API key and the internal token for docker compose:
#   scripts/dev-certs.sh [DIR] [--host NAME ...]     (DIR defaults to certs/)
# With a complete set in DIR, compose starts every port with TLS (docs/deploy.md,
# "TLS and keys in compose"). For development only: the keys are unencrypted files.
set -eu
cd "$(dirname "$0")/.."
dir=certs
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then dir=$1; shift; fi
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
# The compose service names (scheduler, executor) are SANs already.
"$python" -m pagedserve.dev.devcerts "$dir" "$@"
# Containers run as uid 10001: let them read the bind-mounted files (a dev CA, not production).
chmod 0755 "$dir"
chmod 0644 "$dir"/*.crt "$dir"/*.key "$dir"/api-keys "$dir"/internal-token
chmod 0600 "$dir"/ca.key
echo "wrote $dir/: ca.crt scheduler.crt/.key executor.crt/.key api-keys internal-token"
echo "clients: pagedserve generate --tls-ca $dir/ca.crt --api-key \"\$(grep -v '^#' $dir/api-keys | head -n1)\" ..."
