#!/bin/sh
# The images' entrypoint: `lowcomm-node join`, configured from the environment.
#
#   IMAGE [JOIN OPTIONS]            join, built from the variables below, plus these options
#   IMAGE join [JOIN OPTIONS]       the same
#   IMAGE lowcomm-node ARGS...      the same as IMAGE ARGS...
#   IMAGE SUBCOMMAND ARGS...        another subcommand (status, monitor, train, config, ...)
#   IMAGE COMMAND ARGS...           a program of the image (sh, python3)
#   IMAGE --help                    this image's variables, then lowcomm-node's help
#
# Variables (docker/README.md has the long form):
#   LOWCOMM_SWARM / LOWCOMM_MANIFEST   swarm id (configs/swarms/<id>.toml) or a manifest file
#   LOWCOMM_PEERS       bootstrap multiaddrs, separated by commas or spaces
#   LOWCOMM_PEERS_FILE  a file holding more of them (waits up to LOWCOMM_PEERS_WAIT s for it)
#   LOWCOMM_LISTEN      listen multiaddr (default /ip4/0.0.0.0/tcp/4100)
#   LOWCOMM_ANNOUNCE_HOST [LOWCOMM_ANNOUNCE_PORT]  the address peers dial: an IP or DNS name
#                       (the instance's public address), port default the listen port
#   LOWCOMM_ANNOUNCE    or full multiaddrs to announce, separated by commas or spaces
#   LOWCOMM_ANNOUNCE_FILE  write this node's dialable multiaddr (with /p2p/ID) to this file,
#                       for the others' LOWCOMM_PEERS_FILE (compose.yaml uses it)
#   LOWCOMM_DEVICE      train.device (auto, cuda, cpu): the GPU image refuses to start without
#                       a usable GPU unless this (or --set train.device=...) says otherwise
#   LOWCOMM_GPU         train on this GPU of those the container sees (join --gpu N): one
#                       container per GPU with `--gpus all`; or give each container one GPU
#                       with `docker run --gpus device=N` and leave this unset
#   LOWCOMM_DATA_DIR    identity and checkpoints: the volume (default /data)
#   LOWCOMM_MQTT, LOWCOMM_PREEMPTION   read by `join` itself (telemetry, spot notices)
set -eu

LOWCOMM=${LOWCOMM_BIN:-lowcomm-node}
PYTHON=${LOWCOMM_PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
DATA_DIR=${LOWCOMM_DATA_DIR:-/data}
LISTEN=${LOWCOMM_LISTEN:-/ip4/0.0.0.0/tcp/4100}

usage() {
  sed -n '2,/^set -eu/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
  echo
}

has() {  # <option> ARGS...: whether the arguments give this option (--x V or --x=V)
  option=$1
  shift
  for arg in "$@"; do
    case "$arg" in "$option" | "$option"=*) return 0 ;; esac
  done
  return 1
}

device_chosen() {  # ARGS...: whether train.device is set explicitly
  [ -n "${LOWCOMM_DEVICE:-}" ] && return 0
  for arg in "$@"; do
    case "$arg" in train.device=* | --set=train.device=*) return 0 ;; esac
  done
  return 1
}

require_gpu() {  # ARGS...: in the GPU image, no quiet fall-back to the CPU
  if [ "${LOWCOMM_GPU_IMAGE:-0}" = 1 ] && ! device_chosen "$@"; then
    "$PYTHON" "$HERE/require_gpu.py" || exit $?
  fi
}

host_maddr() {  # <IP or DNS name> -> /ip4/..., /ip6/... or /dns/...
  case "$1" in
    *:*) echo "/ip6/$1" ;;
    *[!0-9.]*) echo "/dns/$1" ;;
    *) echo "/ip4/$1" ;;
  esac
}

if [ "${1:-}" = lowcomm-node ]; then
  shift
fi
case "${1:-}" in
  -h | --help)
    usage
    exec "$LOWCOMM" --help
    ;;
  join) shift ;;
  "" | -*) ;;
  train)
    require_gpu "$@"
    exec "$LOWCOMM" "$@"
    ;;
  *)
    if command -v "$1" >/dev/null 2>&1; then
      exec "$@"
    fi
    exec "$LOWCOMM" "$@"
    ;;
esac

# join: the options given win over the environment's
if has --help "$@" || has -h "$@"; then
  exec "$LOWCOMM" join "$@"
fi
if [ -n "${LOWCOMM_DEVICE:-}" ]; then
  set -- --set "train.device=$LOWCOMM_DEVICE" "$@"
fi
if [ -n "${LOWCOMM_GPU:-}" ] && ! has --gpu "$@"; then
  set -- --gpu "$LOWCOMM_GPU" "$@"
fi
require_gpu "$@"
if ! has --swarm "$@" && ! has --manifest "$@"; then
  if [ -n "${LOWCOMM_MANIFEST:-}" ]; then
    set -- --manifest "$LOWCOMM_MANIFEST" "$@"
  elif [ -n "${LOWCOMM_SWARM:-}" ]; then
    set -- --swarm "$LOWCOMM_SWARM" "$@"
  else
    echo "lowcomm-node: set LOWCOMM_SWARM (a swarm id) or LOWCOMM_MANIFEST (a manifest file), or pass --swarm ID; \`docker run IMAGE --help\` lists the variables." >&2
    exit 2
  fi
fi
if has --data-dir "$@"; then
  DATA_DIR=""
fi
if has --listen "$@"; then
  LISTEN=""
fi

port=${LISTEN##*/tcp/}
port=${port%%/*}
ANNOUNCE=$(echo "${LOWCOMM_ANNOUNCE:-}" | tr ',' ' ')
if [ -n "${LOWCOMM_ANNOUNCE_HOST:-}" ]; then
  ANNOUNCE="$(host_maddr "$LOWCOMM_ANNOUNCE_HOST")/tcp/${LOWCOMM_ANNOUNCE_PORT:-${port:-4100}} $ANNOUNCE"
fi
for address in $ANNOUNCE; do
  set -- --announce "$address" "$@"
done

if [ -n "${LOWCOMM_ANNOUNCE_FILE:-}" ]; then
  peer_id=$("$PYTHON" -c 'import sys
from p2p.identity import NodeIdentity, identity_path
print(NodeIdentity.load_or_create(identity_path(sys.argv[1])).peer_id)' "${DATA_DIR:-/data}")
  first=""
  for address in $ANNOUNCE; do
    first=${first:-$address}
  done
  first=${first:-/ip4/$(hostname -i | cut -d' ' -f1)/tcp/${port:-4100}}
  tmp="$LOWCOMM_ANNOUNCE_FILE.tmp.$$"
  echo "$first/p2p/$peer_id" > "$tmp"
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

if [ -n "$LISTEN" ]; then
  set -- --listen "$LISTEN" "$@"
fi
if [ -n "$DATA_DIR" ]; then
  set -- --data-dir "$DATA_DIR" "$@"
fi
exec "$LOWCOMM" join "$@"
