#!/usr/bin/env bash
# Both images (the proxy and the controller), for several platforms, tagged for a registry: pushed to it, or,
# with --offline, written as one OCI archive per image and platform (no registry needed).
#
#   bash images/release.sh --registry registry.example.com/tailscale --tag 0.1.0 \
#        --platforms linux/amd64,linux/arm64 --push [--tool docker|podman]
#   bash images/release.sh --registry registry.example.com/tailscale --tag 0.1.0 \
#        --platforms linux/amd64,linux/arm64 --offline [--out DIR]     # archives, --print-out for DIR
#   ... --push --tool podman --local-bases [--cert-dir DIR] [--authfile FILE]
#
# `make images` and `make images-archives` run it. The images are <registry>/containerboot-py:<tag> and
# <registry>/containerboot-py-controller:<tag>; the chart's default tag is its appVersion, so --tag defaults to
# it (images and chart are versioned together).
#
# --push: with Docker, `docker buildx build --platform ... --push` (BuildKit: the Dockerfiles mount a build
# secret); with podman, `podman build --platform ... --manifest` and `podman manifest push --all`. Foreign
# platforms' RUN steps run under qemu user mode (binfmt_misc), as with any multi-platform build.
# --local-bases (podman): each platform built on its own with this machine's bases (images/base.sh and
# images/tailscale.sh for that architecture) instead of the Dockerfiles' defaults from Docker Hub, added to the
# same manifest list: where the registry is reachable and Docker Hub is not (the lab's registry).
# --cert-dir (a directory with ca.crt) and --authfile (podman's auth file) for a private registry (podman).
# --offline: images/build.sh per platform (a local Debian base per architecture made with mmdebstrap, tailscaled
# cross-compiled with Go), each exported as an archive whose index names the image <registry>/<name>:<tag>,
# as the registry would serve it: `ctr -n k8s.io images import` on a node, or `skopeo copy
# oci-archive:F docker://...` to push it later.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
. "$here/common.sh"

REGISTRY= TAG= PLATFORMS=linux/amd64,linux/arm64 MODE= TOOL= OUT= print= LOCAL_BASES= CERT_DIR= AUTHFILE=
while [ $# -gt 0 ]; do
  case "$1" in
    --registry) REGISTRY=${2%/}; shift 2 ;;
    --tag) TAG=$2; shift 2 ;;
    --platforms) PLATFORMS=$2; shift 2 ;;
    --push) MODE=push; shift ;;
    --offline) MODE=offline; shift ;;
    --tool) TOOL=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --print-out) print=1; shift ;;
    --local-bases) LOCAL_BASES=1; shift ;;
    --cert-dir) CERT_DIR=$2; shift 2 ;;
    --authfile) AUTHFILE=$2; shift 2 ;;
    *) log "unknown argument $1 (see the header of $0)"; exit 2 ;;
  esac
done
[ -n "$REGISTRY" ] || { log "--registry is required: where the images go, e.g. --registry registry.example.com/tailscale (make images REGISTRY=...)"; exit 2; }
if [ -z "$TAG" ]; then
  TAG=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$repo/charts/tailscale-controller/Chart.yaml")
fi
version=$(tr -d '[:space:]' < "$repo/VERSION")   # the one place the version is written
OUT=${OUT:-$IMAGES_CACHE/release/$TAG}
if [ -n "$print" ]; then echo "$OUT"; exit 0; fi
[ -n "$MODE" ] || { log "say --push (to the registry) or --offline (OCI archives)"; exit 2; }
IFS=, read -r -a platforms <<< "$PLATFORMS"
for p in "${platforms[@]}"; do
  case "$p" in linux/amd64|linux/arm64) ;; *) log "platform $p: only linux/amd64 and linux/arm64 are built"; exit 2 ;; esac
done

# image name -> Dockerfile
declare -A DOCKERFILES=([containerboot-py]="$repo/Dockerfile" [containerboot-py-controller]="$repo/images/controller/Dockerfile")
NAMES=(containerboot-py containerboot-py-controller)

ca_secret() {  # the optional `ca` build secret: a CA bundle for a TLS-intercepting proxy in front of PyPI
  local ca
  for ca in "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
    if [ -n "$ca" ] && [ -s "$ca" ]; then echo "--secret=id=ca,src=$ca"; return; fi
  done
}

if [ "$MODE" = offline ]; then
  mkdir -p "$OUT"
  for p in "${platforms[@]}"; do
    arch=${p#linux/}
    [ "$arch" = "$(dpkg --print-architecture)" ] || foreign_ready "$arch"
    for n in "${NAMES[@]}"; do
      bash "$here/build.sh" --platform "$p" --dockerfile "${DOCKERFILES[$n]}" \
        --name "localhost/cbpy-release/$n:$TAG-$arch" --ref "$REGISTRY/$n:$TAG" \
        --archive "$OUT/$n-$TAG-linux-$arch.oci.tar"
    done
  done
  ls -l "$OUT"/*.oci.tar >&2
  exit 0
fi

# --push
if [ -z "$TOOL" ]; then
  if command -v docker >/dev/null 2>&1 && docker buildx version >/dev/null 2>&1; then TOOL=docker
  elif command -v podman >/dev/null 2>&1; then TOOL=podman
  else log "neither docker buildx nor podman is installed"; exit 1; fi
fi
secret=$(ca_secret)
if [ "$TOOL" = docker ] && [ -n "$LOCAL_BASES$CERT_DIR$AUTHFILE" ]; then
  log "--local-bases, --cert-dir and --authfile are podman's (docker: docker login, and the CA in /etc/docker/certs.d)"; exit 2
fi
reg=()
[ -z "$CERT_DIR" ] || reg+=(--cert-dir "$CERT_DIR")
[ -z "$AUTHFILE" ] || reg+=(--authfile "$AUTHFILE")
for n in "${NAMES[@]}"; do
  ref="$REGISTRY/$n:$TAG"
  log "building and pushing $ref for $PLATFORMS with $TOOL"
  case "$TOOL" in
    docker)
      DOCKER_BUILDKIT=1 docker buildx build --platform "$PLATFORMS" -f "${DOCKERFILES[$n]}" \
        --build-arg "VERSION=$version" ${secret:+"$secret"} -t "$ref" --push "$repo" ;;
    podman)
      podman manifest rm "$ref" >/dev/null 2>&1 || true
      if [ -n "$LOCAL_BASES" ]; then
        for p in "${platforms[@]}"; do
          arch=${p#linux/}
          [ "$arch" = "$(dpkg --print-architecture)" ] || foreign_ready "$arch"
          tsimg=$(bash "$here/tailscale.sh" --arch "$arch")
          pod build --network host --pull=never --platform "$p" -f "${DOCKERFILES[$n]}" --build-arg "VERSION=$version" \
            --build-arg "BASE=$(bash "$here/base.sh" --arch "$arch")" --build-arg "TAILSCALE_IMAGE=$tsimg" \
            --build-arg "TAILSCALE_VERSION=$(echo "$tsimg" | sed -n 's/.*:v\([0-9.]*\)-.*/\1/p')" \
            ${secret:+"$secret"} --manifest "$ref" "$repo"
        done
      else
        pod build --platform "$PLATFORMS" -f "${DOCKERFILES[$n]}" --build-arg "VERSION=$version" \
          ${secret:+"$secret"} --manifest "$ref" "$repo"
      fi
      podman manifest push --all "${reg[@]}" "$ref" "docker://$ref"
      podman manifest rm "$ref" >/dev/null 2>&1 || true ;;
    *) log "--tool $TOOL: use docker or podman"; exit 2 ;;
  esac
done
