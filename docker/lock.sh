#!/usr/bin/env bash
# Writes docker/requirements-cpu.lock and docker/requirements-cuda.lock: every Python package
# the two images install, pinned with hashes, for CPython 3.11 on x86_64 Linux (the images'
# base). Run it after changing pyproject's dependencies:  bash docker/lock.sh
#
#   cuda: torch 2.13.0 from PyPI (a CUDA 13.0 build) with the nvidia-* wheels it requires.
#   cpu:  torch's CPU build and its few dependencies; torch itself is left out of this lock
#         (it is installed by version from TORCH_INDEX_URL, the Dockerfile's build argument).
# Where PyTorch's CPU index is unreachable, point TORCH_CPU_WHEELS at a directory that holds
# torch-2.13.0+cpu's wheel (only its metadata is read).
# Needs uv (`pip install uv`): its resolver locks for a platform other than the running one.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-$(command -v uv || echo .venv/bin/uv)}
TORCH_VERSION=2.13.0
if [ ! -x "$UV" ]; then
  echo "docker/lock.sh needs uv: pip install uv (or set UV=/path/to/uv)." >&2
  exit 2
fi
if [ -n "${TORCH_CPU_WHEELS:-}" ]; then
  cpu_source=(--find-links "$TORCH_CPU_WHEELS")
else
  cpu_source=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
fi
image_only=$(mktemp)
trap 'rm -f "$image_only" "$image_only.cpu" "$image_only.cuda"' EXIT
# Not a dependency of the package: the images' PID 1, which forwards `docker stop`'s SIGTERM
# and reaps orphans (a wheel with the static binary, so no apt-get in the images).
echo "dumb-init==1.2.5.post1" > "$image_only"
echo "torch==${TORCH_VERSION}+cpu" > "$image_only.cpu"
echo "torch==${TORCH_VERSION}" > "$image_only.cuda"

compile() {  # <variant> <extra uv arguments...>
  local variant=$1
  shift
  "$UV" pip compile pyproject.toml "$image_only" --constraint "$image_only.$variant" \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes \
    --custom-compile-command "bash docker/lock.sh" --quiet \
    --output-file "docker/requirements-$variant.lock" "$@"
  # the temporary input file's name is not part of the lock
  sed -i "s|$image_only|docker/lock.sh (image only)|g" "docker/requirements-$variant.lock"
}
compile cpu "${cpu_source[@]}" --no-emit-package torch
compile cuda
echo "wrote docker/requirements-cpu.lock and docker/requirements-cuda.lock"
