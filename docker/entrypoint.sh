#!/bin/sh
# The container's entrypoint: `lowcomm-node join`, configured from the environment.
#
#   LOWCOMM_SWARM       swarm id (a manifest in configs/swarms/), or
#   LOWCOMM_MANIFEST    path of a manifest file (e.g. mounted read-only)
#   LOWCOMM_PEERS       bootstrap multiaddrs, separated by commas or spaces
#   LOWCOMM_PEERS_FILE  a file holding more of them (waits up to LOWCOMM_PEERS_WAIT s for it)
#   LOWCOMM_LISTEN      listen multiaddr (default /ip4/0.0.0.0/tcp/4100)
#   LOWCOMM_DATA_DIR    identity and checkpoints: the volume (default /data)
#   LOWCOMM_ANNOUNCE_FILE, LOWCOMM_ANNOUNCE_HOST
#                       write this node's multiaddr (/ip4/HOST/tcp/PORT/p2p/ID) to the file,
#                       for the others' LOWCOMM_PEERS_FILE (compose.yaml uses it)
#   LOWCOMM_MQTT, LOWCOMM_PREEMPTION   read by `join` itself (telemetry, spot notices)
#
# Arguments given to the container are added to `join`'s; a first argument that is not an
# option runs that subcommand instead (`docker run IMAGE status`, `... monitor --mqtt ...`).
set -eu

LOWCOMM=${LOWCOMM_BIN:-lowcomm-node}
PYTHON=${LOWCOMM_PYTHON:-python3}

if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  exec "$LOWCOMM" "$@"
fi

DATA_DIR=${LOWCOMM_DATA_DIR:-/data}
LISTEN=${LOWCOMM_LISTEN:-/ip4/0.0.0.0/tcp/4100}

if [ -n "${LOWCOMM_MANIFEST:-}" ]; then
  set -- --manifest "$LOWCOMM_MANIFEST" "$@"
elif [ -n "${LOWCOMM_SWARM:-}" ]; then
  set -- --swarm "$LOWCOMM_SWARM" "$@"
else
  echo "lowcomm-node: set LOWCOMM_SWARM (a swarm id) or LOWCOMM_MANIFEST (a manifest file)." >&2
  exit 2
fi

if [ -n "${LOWCOMM_ANNOUNCE_FILE:-}" ]; then
  port=${LISTEN##*/tcp/}
  port=${port%%/*}
  peer_id=$("$PYTHON" -c 'import sys
from p2p.identity import NodeIdentity, identity_path
print(NodeIdentity.load_or_create(identity_path(sys.argv[1])).peer_id)' "$DATA_DIR")
  host=${LOWCOMM_ANNOUNCE_HOST:-$(hostname -i | cut -d' ' -f1)}
  tmp="$LOWCOMM_ANNOUNCE_FILE.tmp.$$"
  echo "/ip4/$host/tcp/$port/p2p/$peer_id" > "$tmp"
  mv "$tmp" "$LOWCOMM_ANNOUNCE_FILE"
fi

PEERS=$(echo "${LOWCOMM_PEERS:-}" | tr ',' ' ')
if [ -n "${LOWCOMM_PEERS_FILE:-}" ]; then
  waited=0
  while [ ! -s "$LOWCOMM_PEERS_FILE" ]; do
    if [ "$waited" -ge "${LOWCOMM_PEERS_WAIT:-120}" ]; then
      echo "lowcomm-node: no bootstrap address in $LOWCOMM_PEERS_FILE after ${waited}s." >&2
      exit 1
    fi
    sleep 1
    waited=$((waited + 1))
  done
  PEERS="$PEERS $(tr ',\n' '  ' < "$LOWCOMM_PEERS_FILE")"
fi
for peer in $PEERS; do
  set -- --peer "$peer" "$@"
done

exec "$LOWCOMM" join --data-dir "$DATA_DIR" --listen "$LISTEN" "$@"
