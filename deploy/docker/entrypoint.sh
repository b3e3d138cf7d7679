#!/bin/sh
# Entry point of the psg images: runs the container's command, after joining a Ray cluster when
# PSG_RAY_JOIN names one.
#
# A Ray driver must run on a node of its cluster, so the frontend container (psg-server
# --ray-address ...) first starts a Ray node of its own with no CPUs and no GPUs: nothing is
# scheduled on it, and its object store holds the parameter sets psg-server puts there.
#
# Every Ray node started here (that join, or a command `ray start ...`) gets an object store that
# fits the container's /dev/shm, unless the flags already size it: Ray's default is 30% of the
# memory, and when that exceeds /dev/shm (a compose shm_size, docker run --shm-size) and is below
# 10 GB, Ray puts the store on disk ("This will harm performance!"). The size is 30% of the memory
# (the container's memory limit, if lower than the host's), at most 90% of /dev/shm.
#
#   PSG_RAY_JOIN            host:port of the Ray head (its GCS), e.g. ray-head:6379; unset = no join
#   PSG_RAY_JOIN_ARGS       extra `ray start` flags for that node, split on spaces
#                           (e.g. --object-store-memory=2000000000)
#   PSG_OBJECT_STORE_BYTES  the object store size of every node started here, instead of the rule
set -eu

# Where the memory figures are read (a test points them elsewhere).
proc="${PSG_ENTRYPOINT_PROC:-/proc}"
cgroup="${PSG_ENTRYPOINT_CGROUP:-/sys/fs/cgroup}"

# Bytes of object store for a node of this container, or nothing (Ray's default) when /dev/shm
# cannot hold a useful store (Docker's 64 MB default: raise shm_size).
object_store_bytes() {
    if [ -n "${PSG_OBJECT_STORE_BYTES:-}" ]; then
        echo "$PSG_OBJECT_STORE_BYTES"
        return
    fi
    shm=$(df -P -k /dev/shm 2>/dev/null | awk 'NR == 2 {printf "%.0f", $2 * 1024}') || shm=""
    memory=$(awk '$1 == "MemTotal:" {printf "%.0f", $2 * 1024}' "$proc/meminfo" 2>/dev/null) || memory=""
    for limit in "$cgroup/memory.max" "$cgroup/memory/memory.limit_in_bytes"; do
        value=$(cat "$limit" 2>/dev/null) || continue
        case "$value" in
            '' | *[!0-9]*) ;;  # "max": no limit
            *) memory=$(awk -v a="${memory:-$value}" -v b="$value" 'BEGIN {printf "%.0f", (b + 0 < a + 0) ? b : a}') ;;
        esac
    done
    if [ -z "$shm" ] || [ -z "$memory" ]; then
        return 0
    fi
    size=$(awk -v shm="$shm" -v memory="$memory" 'BEGIN {
        size = memory * 0.3
        if (size > shm * 0.9) size = shm * 0.9
        if (size >= 100 * 1024 * 1024) printf "%.0f", int(size)
    }')
    if [ -z "$size" ]; then
        echo "psg-entrypoint: /dev/shm holds only $shm bytes: Ray's object store will be on disk; give the" \
            "container more shared memory (compose shm_size, docker run --shm-size)" >&2
        return 0
    fi
    echo "psg-entrypoint: Ray's object store: $size bytes (memory $memory, /dev/shm $shm)" >&2
    echo "$size"
}

# Whether the arguments already size the object store.
sizes_object_store() {
    for arg in "$@"; do
        case "$arg" in
            --object-store-memory | --object-store-memory=*) return 0 ;;
        esac
    done
    return 1
}

if [ -n "${PSG_RAY_JOIN:-}" ]; then
    join_store=""
    case " ${PSG_RAY_JOIN_ARGS:-} " in
        *" --object-store-memory"*) ;;
        *)
            size=$(object_store_bytes)
            if [ -n "$size" ]; then
                join_store="--object-store-memory=$size"
            fi
            ;;
    esac
    # shellcheck disable=SC2086  # PSG_RAY_JOIN_ARGS is a list of flags
    ray start --address="${PSG_RAY_JOIN}" --num-cpus=0 --num-gpus=0 --disable-usage-stats \
        ${PSG_RAY_JOIN_ARGS:-} $join_store
fi

# A Ray node as the container's command (the head, a worker).
if [ "$#" -ge 2 ] && [ "$1" = ray ] && [ "$2" = start ] && ! sizes_object_store "$@"; then
    size=$(object_store_bytes)
    if [ -n "$size" ]; then
        set -- "$@" "--object-store-memory=$size"
    fi
fi

exec "$@"
