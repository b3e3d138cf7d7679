#!/bin/sh
# The images' HEALTHCHECK (installed as psg-container-health). One image serves every role of a
# cluster, so what "healthy" means depends on what the container runs:
#
#   psg-server (the frontend)   its gRPC health service answers SERVING (psg-health; PSG_HEALTH_*
#                               variables configure TLS, as in deploy/docker-compose.tls.yml)
#   a Ray node (head, worker)   its raylet is registered and alive: the dashboard agent answers
#                               /api/local_raylet_healthz on PSG_RAYLET_HEALTH_PORT (default 52365,
#                               Ray's default --dashboard-agent-listen-port)
#   anything else               no check of ours: healthy while it runs
#
# Compose gives each service a check of its own anyway; this one is for `docker run` (a GPU worker
# host of deploy/README.md section 6) and other runtimes that use the image's HEALTHCHECK.
set -eu

# Where process command lines are read (a test points it elsewhere).
proc="${PSG_HEALTH_PROC:-/proc}"

# Whether a process of this container has $1 in its command line. Each line is read by the shell
# itself, so no helper process of this check matches.
running() {
    for cmdline in "$proc"/[0-9]*/cmdline; do
        [ -r "$cmdline" ] || continue
        line=$(tr '\000' ' ' < "$cmdline" 2>/dev/null) || continue
        case "$line" in
            *"$1"*) return 0 ;;
        esac
    done
    return 1
}

if running psg-server; then
    exec psg-health --timeout 5
fi
if running raylet; then
    exec wget -q -O /dev/null -T 5 "http://127.0.0.1:${PSG_RAYLET_HEALTH_PORT:-52365}/api/local_raylet_healthz"
fi
exit 0
