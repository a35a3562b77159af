#!/bin/sh
# Compose entrypoint wrapper (after tini): runs the service command unchanged, plus the
# TLS and key flags when $PAGEDSERVE_CERTS (default /certs, compose bind-mounts ./certs
# there) holds the files scripts/dev-certs.sh writes. Without them the service runs in
# plaintext, as before. Flags added (docs/deploy.md, "TLS and keys in compose"):
#   scheduler_svc: --tls-cert/--tls-key scheduler.crt/.key (public port and client certificate
#                  to executors), --tls-ca ca.crt (mutual TLS to executors), --executor-tls-server-name
#                  executor (executors register container addresses; their certificate says
#                  "executor"), --internal-token-file internal-token, --api-key-file api-keys
#   executor_svc:  --tls-cert/--tls-key executor.crt/.key, --tls-ca ca.crt (only schedulers with a
#                  certificate signed by it connect), --internal-token-file internal-token,
#                  --peer-tls-server-name executor (KV that moves: it reads peers' blocks at their
#                  container addresses, whose certificate says "executor")
set -eu
certs=${PAGEDSERVE_CERTS:-/certs}
module=
prev=
for arg in "$@"; do
    [ "$prev" = "-m" ] && module=$arg
    prev=$arg
done
case "$module" in
    scheduler_svc) role=scheduler ;;
    executor_svc) role=executor ;;
    *) exec "$@" ;;
esac
have() { for f in "$@"; do [ -r "$certs/$f" ] || return 1; done; }
if ! have ca.crt "$role.crt" "$role.key" internal-token; then
    echo "with-certs: no complete dev-certs set in $certs: $module runs in plaintext (scripts/dev-certs.sh writes one)" >&2
    exec "$@"
fi
set -- "$@" --tls-cert "$certs/$role.crt" --tls-key "$certs/$role.key" --tls-ca "$certs/ca.crt" \
    --internal-token-file "$certs/internal-token"
if [ "$role" = executor ]; then
    set -- "$@" --peer-tls-server-name executor
fi
if [ "$role" = scheduler ]; then
    set -- "$@" --executor-tls-server-name executor
    if have api-keys; then
        set -- "$@" --api-key-file "$certs/api-keys"
    fi
fi
echo "with-certs: $module with TLS and keys from $certs" >&2
exec "$@"
