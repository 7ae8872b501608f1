#!/usr/bin/env bash
# Build the images docker-compose.yml runs, from deploy/Dockerfile.superexec (and, without a
# registry, deploy/Dockerfile.flwr). Run from anywhere; needs a running Docker daemon.
#
#   deploy/build-images.sh             registry path: pull Flower's flwr/superlink, flwr/supernode,
#                                      flwr/superexec:<flwr version>, build oneshot-fl-superexec on
#                                      flwr/superexec with torch from PyTorch's CPU index
#   deploy/build-images.sh --local     no registry: debootstrap a Debian base (oneshot-fl/debian:bookworm,
#                                      needs debootstrap and root), build stand-ins for Flower's
#                                      three images from deploy/Dockerfile.flwr and tag them
#                                      flwr/<role>:<flwr version>, then build oneshot-fl-superexec on them
#
# The app image gets exactly the torch and torchvision versions pyproject.toml pins (what the tests ran
# with), whatever the building machine holds; benchmarks/compose_check.py checks them inside the container.
#
# Environment (optional):
#   WHEELS_DIR       folder with CPU wheels (default /opt/wheels); --local uses the torch-<pin>+cpu wheel there
#                    for this Python (cp311) if there is one; a wheel of another version is never used
#   TORCH_INDEX_URL  extra index for torch (default https://download.pytorch.org/whl/cpu with the
#                    registry path; "" with --local, where that host is often unreachable)
#   PIP_CA_BUNDLE    CA bundle pip must trust inside builds (default: pip's `cert` setting or
#                    /etc/ssl/certs/ca-certificates.crt); served, not copied, to the build
#   DEBIAN_MIRROR    debootstrap mirror (default http://deb.debian.org/debian)
#   REBUILD_BASE=1   debootstrap again even if oneshot-fl/debian:bookworm exists
#   BUILD_FILES_PORT port on the docker bridge the build files are served on (default 18731)
# Prints one line per image at the end: name, size, seconds it took.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODE=registry
case "${1:-}" in
    --local) MODE=local ;;
    --registry|"") MODE=registry ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "usage: $0 [--local|--registry]" >&2; exit 2 ;;
esac

pin() {  # pin <distribution>: the version pyproject.toml's dependencies pin it to (`name==X` or `name[extra]==X`)
    python3 -c "import re,sys,tomllib; d=tomllib.load(open(sys.argv[1],'rb'))['project']['dependencies']; print(next(x.split('==')[1] for x in d if re.match(re.escape(sys.argv[2]) + r'(\[.*\])?==', x)))" "$ROOT/pyproject.toml" "$1"
}
FLWR_VERSION=$(pin flwr)
TORCH_VERSION=$(pin torch)
TORCHVISION_VERSION=$(pin torchvision)
BASE_TAG=oneshot-fl/debian:bookworm
APP_TAG=oneshot-fl-superexec:latest
WHEELS_DIR=${WHEELS_DIR:-/opt/wheels}
declare -A SECONDS_FOR=()

timed() {  # timed <label> <command...>
    local label=$1 start=$SECONDS; shift
    echo "== $label: $*" >&2
    "$@"
    SECONDS_FOR[$label]=$((SECONDS - start))
}

ca_bundle() {
    if [[ -n "${PIP_CA_BUNDLE:-}" ]]; then echo "$PIP_CA_BUNDLE"; return; fi
    local cert
    cert=$(python3 -m pip config get global.cert 2>/dev/null || true)
    echo "${cert:-/etc/ssl/certs/ca-certificates.crt}"
}

SERVE_DIR="" SERVE_PID=""
cleanup() {
    [[ -n "$SERVE_PID" ]] && kill "$SERVE_PID" 2>/dev/null || true
    [[ -n "$SERVE_DIR" ]] && rm -rf "$SERVE_DIR"
}
trap cleanup EXIT

serve_build_files() {  # an HTTP folder on the docker bridge with ca-bundle.crt and wheels/, for the builds only
    local bridge port
    bridge=$(ip -4 -o addr show docker0 2>/dev/null | awk '{print $4}' | cut -d/ -f1)
    [[ -n "$bridge" ]] || { echo "no docker0 bridge address; is dockerd running?" >&2; exit 1; }
    SERVE_DIR=$(mktemp -d /tmp/oneshot-fl-build.XXXXXX)
    mkdir -p "$SERVE_DIR/wheels" "$SERVE_DIR/context"  # context: Dockerfile.flwr copies nothing
    cp "$(ca_bundle)" "$SERVE_DIR/ca-bundle.crt"
    if [[ -n "${TORCH_WHEEL:-}" ]]; then ln -s "$TORCH_WHEEL" "$SERVE_DIR/wheels/"; fi
    # a fixed port: the URL is a build arg, and a changed arg would invalidate every cached layer after it
    port=${BUILD_FILES_PORT:-18731}
    python3 -m http.server --bind "$bridge" --directory "$SERVE_DIR" "$port" >/dev/null 2>&1 &
    SERVE_PID=$!
    BUILD_FILES_URL="http://$bridge:$port"
    for _ in $(seq 50); do
        python3 -c "import urllib.request as u; u.urlopen('$BUILD_FILES_URL/ca-bundle.crt', timeout=1)" 2>/dev/null && return
        sleep 0.2
    done
    echo "could not serve build files at $BUILD_FILES_URL" >&2; exit 1
}

slim_rootfs() {  # no apt lists or caches, docs (copyright files stay), man pages, translations: -120 MB
    local root=$1
    rm -rf "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/* "$root"/usr/share/man/* \
        "$root"/usr/share/info/* "$root"/usr/share/locale/*
    find "$root"/usr/share/doc -type f ! -name copyright -delete
    # and none from later apt-get installs
    printf '%s\n' 'path-exclude=/usr/share/doc/*' 'path-include=/usr/share/doc/*/copyright' \
        'path-exclude=/usr/share/man/*' 'path-exclude=/usr/share/info/*' 'path-exclude=/usr/share/locale/*' \
        > "$root"/etc/dpkg/dpkg.cfg.d/01-oneshot-fl-slim
    printf '%s\n' 'Dir::Cache::pkgcache "";' 'Dir::Cache::srcpkgcache "";' > "$root"/etc/apt/apt.conf.d/01-oneshot-fl-slim
}

TORCH_WHEEL=""
if [[ "$MODE" == local ]]; then
    TORCH_INDEX_URL=${TORCH_INDEX_URL-}
    TORCH_WHEEL=$(ls -1 "$WHEELS_DIR"/torch-"$TORCH_VERSION"+cpu-cp311-cp311-*linux*x86_64.whl 2>/dev/null | tail -1 || true)
    if [[ -n "$TORCH_WHEEL" ]]; then
        echo "torch: local CPU wheel $TORCH_WHEEL" >&2
    else
        echo "torch: no torch-$TORCH_VERSION+cpu wheel in $WHEELS_DIR; torch $TORCH_VERSION from the package index" \
             "(on PyPI the CUDA build: several GB of nvidia-* wheels in the image)" >&2
    fi
    if [[ "${REBUILD_BASE:-0}" == 1 ]] || ! docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
        rootfs=$(mktemp -d /tmp/oneshot-fl-rootfs.XXXXXX)
        timed debootstrap debootstrap --variant=minbase bookworm "$rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/dev/null
        slim_rootfs "$rootfs"
        timed import bash -c "tar -C '$rootfs' -c . | docker import - '$BASE_TAG' >/dev/null"
        rm -rf "$rootfs"
    fi
    serve_build_files
    for role in superlink supernode superexec; do
        timed "flwr/$role:$FLWR_VERSION" docker build -q -f "$ROOT/deploy/Dockerfile.flwr" --target "$role" \
            --build-arg BASE_IMAGE="$BASE_TAG" --build-arg FLWR_VERSION="$FLWR_VERSION" \
            --build-arg BUILD_FILES_URL="$BUILD_FILES_URL" -t "flwr/$role:$FLWR_VERSION" "$SERVE_DIR/context"
    done
else
    TORCH_INDEX_URL=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
    BUILD_FILES_URL=""
    for role in superlink supernode superexec; do
        timed "flwr/$role:$FLWR_VERSION" docker pull -q "flwr/$role:$FLWR_VERSION"
    done
fi

timed "$APP_TAG" docker build -q -f "$ROOT/deploy/Dockerfile.superexec" \
    --build-arg BASE_IMAGE="flwr/superexec:$FLWR_VERSION" --build-arg TORCH_VERSION="$TORCH_VERSION" \
    --build-arg TORCHVISION_VERSION="$TORCHVISION_VERSION" \
    --build-arg TORCH_INDEX_URL="${TORCH_INDEX_URL}" --build-arg BUILD_FILES_URL="$BUILD_FILES_URL" \
    -t "$APP_TAG" "$ROOT"

echo "images (mode $MODE, flwr $FLWR_VERSION, torch $TORCH_VERSION, torchvision $TORCHVISION_VERSION):"
for image in "flwr/superlink:$FLWR_VERSION" "flwr/supernode:$FLWR_VERSION" "flwr/superexec:$FLWR_VERSION" "$APP_TAG"; do
    size=$(docker image inspect -f '{{.Size}}' "$image")
    echo "image $image size_bytes=$size seconds=${SECONDS_FOR[$image]:-0}"
done
for step in debootstrap import; do
    [[ -n "${SECONDS_FOR[$step]:-}" ]] && echo "step $step seconds=${SECONDS_FOR[$step]}"
done
exit 0
