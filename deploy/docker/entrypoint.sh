#!/bin/sh
# The container's entrypoint: `specula serve` listening on all interfaces.
#
#   (no arguments)                 specula serve smollm2-135m (the Dockerfile's CMD)
#   MODEL [FLAGS...]               specula serve MODEL FLAGS...
#   serve [MODEL] [FLAGS...]       the same
#   fetch|inspect|generate|...     that specula command, unchanged
#
# `serve` gets `--host "$SPECULA_HOST"` (default 0.0.0.0) and `--port "$SPECULA_PORT"` (default
# 8080) unless the arguments name them, and `--api-key` from $SPECULA_API_KEY_FILE (a mounted
# secret) or $SPECULA_API_KEY unless the arguments name one. The HEALTHCHECK probes
# $SPECULA_PORT: change the port with that variable rather than with --port.
# exec: specula becomes PID 1 and gets SIGTERM itself (it drains, then exits).
set -eu

case "${1:-}" in
    serve) shift ;;
    fetch|inspect|generate|bench|loadtest|train|help|--help|-h|--version|-V)
        exec specula "$@" ;;
esac

need_host=1
need_port=1
need_key=1
for arg in "$@"; do
    case "$arg" in
        --host|--host=*) need_host=0 ;;
        --port|--port=*) need_port=0 ;;
        --api-key|--api-key=*) need_key=0 ;;
    esac
done

set -- serve "$@"
if [ "$need_host" = 1 ]; then
    set -- "$@" --host "${SPECULA_HOST:-0.0.0.0}"
fi
if [ "$need_port" = 1 ]; then
    set -- "$@" --port "${SPECULA_PORT:-8080}"
fi
if [ "$need_key" = 1 ]; then
    if [ -n "${SPECULA_API_KEY_FILE:-}" ]; then
        key=$(cat "$SPECULA_API_KEY_FILE")
        if [ -z "$key" ]; then
            echo "specula-entrypoint: $SPECULA_API_KEY_FILE is empty" >&2
            exit 64
        fi
        set -- "$@" --api-key "$key"
    elif [ -n "${SPECULA_API_KEY:-}" ]; then
        set -- "$@" --api-key "$SPECULA_API_KEY"
    fi
fi
exec specula "$@"
