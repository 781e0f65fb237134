#!/usr/bin/env bash
# The image's entrypoint (under tini): the container's role is its command.
#
#   serve [ARGS]      semcache serve: the gateway and the vLLM servers its config launches
#                     (the image's config: the embedded default, SmolLM2 prefill + decode)
#   gateway [ARGS]    semcache serve --no-launch: the gateway alone, vLLM elsewhere
#   prefill [ARGS]    semcache backends run BACKEND/prefill: one vLLM server of the config's
#   decode [ARGS]     pool, on 0.0.0.0:$VLLM_PORT (8000); with $SEMCACHE_JOIN it joins those
#                     gateways once healthy and drains out of them on SIGTERM
#   health            exit 0 when this container's server answers GET /health (HEALTHCHECK)
#   anything else     run as given (semcache config check, bash, ...)
#
# Config and policy: mounted files ($SEMCACHE_CONFIG, default /etc/semcache/config.toml; the
# policy the config names). Secrets: the environment (SEMCACHE_API_TOKEN for the image's
# config, SEMCACHE_ADMIN_TOKEN, SEMCACHE_CACHE_SALT_SECRET). $SEMCACHE_BACKEND names the
# vLLM backend of a prefill/decode role when the config has several.
set -euo pipefail

HEALTH_PORT_FILE=/tmp/semcache-health-port

role=${1:-serve}
[[ $# -gt 0 ]] && shift
case "$role" in
    serve | gateway)
        port=${SEMCACHE_PORT:-8080}
        echo "$port" >"$HEALTH_PORT_FILE"
        extra=()
        [[ "$role" == gateway ]] && extra=(--no-launch)
        exec semcache serve --host "${SEMCACHE_HOST:-0.0.0.0}" --port "$port" "${extra[@]}" "$@"
        ;;
    prefill | decode)
        port=${VLLM_PORT:-8000}
        echo "$port" >"$HEALTH_PORT_FILE"
        exec semcache backends run "${SEMCACHE_BACKEND:+$SEMCACHE_BACKEND/}$role" \
            --host 0.0.0.0 --port "$port" "$@"
        ;;
    health)
        port=$(cat "$HEALTH_PORT_FILE" 2>/dev/null || echo "${SEMCACHE_PORT:-8080}")
        exec curl -fsS -o /dev/null --max-time 4 "http://127.0.0.1:$port/health"
        ;;
    *)
        exec "$role" "$@"
        ;;
esac
