#!/bin/sh
# Creates the secrets of deploy/docker-compose.yml (once per deployment):
#   secrets/psg_tokens.txt   bearer tokens of the trainers ("label token" per line)
#   secrets/ray_auth_token   the token every Ray node of the cluster presents to the others
# and, with --tls SERVER_NAME, what deploy/docker-compose.tls.yml mounts (needs openssl):
#   secrets/tls/ca.pem       a private CA (give it to the trainers: they verify the server with it)
#   secrets/tls/ca.key       its key (keep it here, offline if you can: it signs certificates)
#   secrets/tls/server.pem   the frontend's certificate for SERVER_NAME (and localhost, 127.0.0.1)
#   secrets/tls/server.key   its key
#
#   usage: make-secrets.sh [--tls SERVER_NAME] [UID]
#
# Existing files are kept. The files are readable only by their owner; pass the uid the images
# run as (1000) to hand them to it:  sudo deploy/make-secrets.sh 1000
set -eu
cd "$(dirname "$0")"

tls_name=""
if [ "${1:-}" = "--tls" ]; then
    if [ -z "${2:-}" ]; then
        echo "usage: make-secrets.sh [--tls SERVER_NAME] [UID]" >&2
        exit 2
    fi
    tls_name="$2"
    shift 2
fi
owner="${1:-}"

mkdir -p secrets
umask 077

random_hex() {
    od -An -tx1 -N32 /dev/urandom | tr -d ' \n'
}

if [ ! -s secrets/psg_tokens.txt ]; then
    printf 'trainer %s\n' "$(random_hex)" > secrets/psg_tokens.txt
    echo "wrote deploy/secrets/psg_tokens.txt (label 'trainer'; add one line per trainer)"
fi
if [ ! -s secrets/ray_auth_token ]; then
    random_hex > secrets/ray_auth_token
    echo "wrote deploy/secrets/ray_auth_token"
fi
files="secrets/psg_tokens.txt secrets/ray_auth_token"

if [ -n "$tls_name" ]; then
    mkdir -p secrets/tls
    if [ ! -s secrets/tls/ca.pem ]; then
        openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 -days 3650 \
            -subj "/CN=psg private CA" -addext "basicConstraints=critical,CA:TRUE" \
            -addext "keyUsage=critical,keyCertSign,cRLSign" \
            -keyout secrets/tls/ca.key -out secrets/tls/ca.pem 2>/dev/null
        echo "wrote deploy/secrets/tls/ca.pem and ca.key (a private CA)"
    fi
    if [ ! -s secrets/tls/server.pem ]; then
        # The probe inside the container connects to 127.0.0.1: the certificate names it too.
        san="DNS:${tls_name},DNS:localhost,IP:127.0.0.1"
        case "$tls_name" in
            *[!0-9.]*) ;;
            *) san="IP:${tls_name},DNS:localhost,IP:127.0.0.1" ;;  # an IPv4 address
        esac
        openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 \
            -subj "/CN=${tls_name}" -keyout secrets/tls/server.key -out secrets/tls/server.csr 2>/dev/null
        printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=%s\n' \
            "$san" > secrets/tls/server.ext
        openssl x509 -req -in secrets/tls/server.csr -CA secrets/tls/ca.pem -CAkey secrets/tls/ca.key \
            -CAcreateserial -sha256 -days 825 -extfile secrets/tls/server.ext -out secrets/tls/server.pem 2>/dev/null
        rm -f secrets/tls/server.csr secrets/tls/server.ext secrets/tls/ca.srl
        echo "wrote deploy/secrets/tls/server.pem and server.key (for ${tls_name})"
    fi
    files="$files secrets/tls/ca.pem secrets/tls/server.pem secrets/tls/server.key"
fi

if [ -n "$owner" ]; then
    # shellcheck disable=SC2086  # a list of paths without spaces
    chown "$owner" $files
fi
echo "a trainer's token: sudo awk '\$1 == \"trainer\" {print \$2}' deploy/secrets/psg_tokens.txt"
