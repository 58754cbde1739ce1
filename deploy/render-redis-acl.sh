#!/bin/sh
# Render deploy/redis-users.acl into the file redis-server loads with --aclfile:
#   sh render-redis-acl.sh TEMPLATE OUTPUT
# Comments and blank lines go (an ACL file has no comment syntax), each <ROLE_PASSWORD>
# placeholder is filled from the environment, and a role whose variable is unset or empty
# is left out (that user does not exist, so nobody can log in as it):
#   REDIS_PASSWORD            default (operators, probes)   required
#   REDIS_SUBMITTER_PASSWORD  agentbatch-submitter
#   REDIS_WORKER_PASSWORD     agentbatch-worker
#   REDIS_FLOWER_PASSWORD     agentbatch-flower
#   REDIS_KEDA_PASSWORD       agentbatch-keda
# Passwords go into redis:// URLs unescaped, so only letters, digits and . _ ~ - are
# accepted (e.g. `openssl rand -hex 24`). compose/, k8s/ and tests/integration/
# test_redis_acl.py all render with this script.
set -eu
template=$1
out=$2
: "${REDIS_PASSWORD:?REDIS_PASSWORD (the default user: operators and probes) must be set}"
umask 077
tmp="$out.tmp"
sed -e '/^[[:space:]]*#/d' -e '/^[[:space:]]*$/d' "$template" > "$tmp"
for role in ADMIN SUBMITTER WORKER FLOWER KEDA; do
    if [ "$role" = ADMIN ]; then var=REDIS_PASSWORD; else var="REDIS_${role}_PASSWORD"; fi
    eval "value=\${$var:-}"
    if [ -z "$value" ]; then
        sed -e "/<${role}_PASSWORD>/d" "$tmp" > "$tmp.next"
    else
        case "$value" in
            *[!A-Za-z0-9._~-]*)
                echo "render-redis-acl: $var may hold only letters, digits and . _ ~ -" >&2
                rm -f "$tmp"
                exit 2 ;;
        esac
        sed -e "s/<${role}_PASSWORD>/${value}/g" "$tmp" > "$tmp.next"
    fi
    mv "$tmp.next" "$tmp"
done
if grep -q '<[A-Z_]*_PASSWORD>' "$tmp"; then
    echo "render-redis-acl: unknown password placeholders in $template" >&2
    rm -f "$tmp"
    exit 2
fi
mv "$tmp" "$out"
