#!/bin/sh
# Entry point of the psg images: runs the container's command, after joining a Ray cluster when
# PSG_RAY_JOIN names one.
#
# A Ray driver must run on a node of its cluster, so the frontend container (psg-server
# --ray-address ...) first starts a Ray node of its own with no CPUs and no GPUs: nothing is
# scheduled on it, and its object store holds the parameter sets psg-server puts there.
#
#   PSG_RAY_JOIN        host:port of the Ray head (its GCS), e.g. ray-head:6379; unset = no join
#   PSG_RAY_JOIN_ARGS   extra `ray start` flags for that node, split on spaces
#                       (e.g. --object-store-memory=2000000000)
set -eu

if [ -n "${PSG_RAY_JOIN:-}" ]; then
    # shellcheck disable=SC2086  # PSG_RAY_JOIN_ARGS is a list of flags
    ray start --address="${PSG_RAY_JOIN}" --num-cpus=0 --num-gpus=0 --disable-usage-stats \
        ${PSG_RAY_JOIN_ARGS:-}
fi

exec "$@"
