#!/bin/sh
# Creates the two secrets of deploy/docker-compose.yml (once per deployment):
#   secrets/psg_tokens.txt   bearer tokens of the trainers ("label token" per line)
#   secrets/ray_auth_token   the token every Ray node of the cluster presents to the others
# Existing files are kept. The files are readable only by their owner; pass the uid the images
# run as (1000) to hand them to it:  sudo deploy/make-secrets.sh 1000
set -eu
cd "$(dirname "$0")"
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
if [ "$#" -ge 1 ]; then
    chown "$1" secrets/psg_tokens.txt secrets/ray_auth_token
fi
