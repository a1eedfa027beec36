#!/usr/bin/env bash
# Builds an image of this repository offline (no registry) into local podman storage, and exports it as an
# OCI archive that containerd can import. `make image` runs it for the proxy image.
#
#   bash images/build.sh                       # the proxy image: Dockerfile -> localhost/containerboot-py:latest
#   bash images/build.sh --dockerfile images/controller/Dockerfile --name localhost/containerboot-py-controller:latest
#   bash images/build.sh --print-archive       # the archive's path (for `ctr -n k8s.io images import`)
#   bash images/build.sh --print-name          # the image name
#   bash images/build.sh --iidfile FILE        # also write the built image's ID to FILE (the name is shared
#                                              # by every checkout on the machine; the ID is what was built)
#   bash images/build.sh --platform linux/arm64 --name localhost/x:1-arm64 --archive F --ref reg/x:1
#                                              # another architecture (its RUN steps under qemu user mode),
#                                              # exported to F with the reference a registry would serve it as
#
# The Dockerfile is built unchanged, as Docker would build it elsewhere; only its ARGs differ: BASE is a local
# Debian base made by images/base.sh and TAILSCALE_IMAGE a local image of the Go-built binaries
# (images/tailscale.sh). The host's CA bundle is passed as the optional `ca` build secret (a TLS-intercepting
# proxy between the build and PyPI needs it; it never enters a layer).
#
# Cached at every level: the base and the tailscale image are tagged with their recipe's hash and reused;
# podman's layer cache skips unchanged steps; the archive is re-exported only when the image ID changes.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
. "$here/common.sh"

NAME=localhost/containerboot-py:latest
DOCKERFILE=$repo/Dockerfile
CONTEXT=$repo
print=
iidfile=
PLATFORM=
ARCHIVE=
REF=
while [ $# -gt 0 ]; do
  case "$1" in
    --platform) PLATFORM=$2; shift 2 ;;
    --archive) ARCHIVE=$2; shift 2 ;;
    --ref) REF=$2; shift 2 ;;
    --name) NAME=$2; shift 2 ;;
    --dockerfile) DOCKERFILE=$2; shift 2 ;;
    --context) CONTEXT=$2; shift 2 ;;
    --print-archive) print=archive; shift ;;
    --print-name) print=name; shift ;;
    --iidfile) iidfile=$2; shift 2 ;;
    *) log "unknown argument $1 (see the header of $0)"; exit 2 ;;
  esac
done
ARCHIVE=${ARCHIVE:-$(archive_path "$NAME")}
REF=${REF:-$NAME}
NATIVE=$(dpkg --print-architecture)
ARCH=${PLATFORM#linux/}
ARCH=${ARCH:-$NATIVE}
case "$PLATFORM" in ""|linux/*) ;; *) log "--platform $PLATFORM: only linux/<arch> (linux/amd64, linux/arm64)"; exit 2 ;; esac
case "$print" in
  archive) echo "$ARCHIVE"; exit 0 ;;
  name) echo "$NAME"; exit 0 ;;
esac
command -v podman >/dev/null || { log "podman is missing: run scripts/setup.sh --image"; exit 1; }

start=$(date +%s.%N)
base=$(bash "$here/base.sh" --arch "$ARCH")
tsimg=$(bash "$here/tailscale.sh" --arch "$ARCH")
version=$(tr -d '[:space:]' < "$repo/VERSION")   # the one place the version is written
ts_version=$(echo "$tsimg" | sed -n 's/.*:v\([0-9.]*\)-.*/\1/p')
secret=()
for ca in "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
  if [ -n "$ca" ] && [ -s "$ca" ]; then secret=(--secret "id=ca,src=$ca"); break; fi
done
tmpid=$(mktemp)
trap 'rm -f "$tmpid"' EXIT
# The image this build replaces, if this checkout made it (several checkouts share the machine's storage and
# this name; another checkout's image may be in use by its tests, by ID).
old=$(podman image inspect --format '{{.Id}} {{index .Labels "io.containerboot-py.checkout"}}' "$NAME" 2>/dev/null || true)
case "$old" in
  *" $repo") old=${old%% *} ;;
  *) old= ;;
esac
log "building $NAME for linux/$ARCH from $DOCKERFILE (BASE=$base, TAILSCALE_IMAGE=$tsimg, runtime $(oci_runtime))"
# --network host: build steps (apt, pip) use the host's own network as any process does. The default bridge
# network would make podman (netavark) add NAT chains to the host's firewall and turn on the host's IP
# forwarding, which a build has no business changing.
pod build --layers --pull=never --network host -q --platform "linux/$ARCH" -f "$DOCKERFILE" -t "$NAME" \
  --build-arg "BASE=$base" --build-arg "TAILSCALE_IMAGE=$tsimg" \
  --build-arg "VERSION=$version" --build-arg "TAILSCALE_VERSION=${ts_version:-unknown}" \
  --label "io.containerboot-py.checkout=$repo" --iidfile "$tmpid" "${secret[@]}" "$CONTEXT" >/dev/null
id=$(cat "$tmpid"); id=${id#sha256:}
[ -z "$iidfile" ] || echo "$id" > "$iidfile"
# The image this one replaces is now untagged; remove it (only it: other dangling images are not ours). It
# stays if a container uses it.
if [ -n "$old" ] && [ "$old" != "$id" ]; then podman rmi "$old" >/dev/null 2>&1 || true; fi

mkdir -p "$IMAGES_CACHE" "$(dirname "$ARCHIVE")"
if [ ! -s "$ARCHIVE" ] || [ "$(cat "$ARCHIVE.id" 2>/dev/null)" != "$id" ]; then
  rm -f "$ARCHIVE.id"
  if [ "$REF" = "$NAME" ]; then
    podman save -q --format oci-archive -o "$ARCHIVE.tmp" "$NAME" >/dev/null  # (a concurrent build elsewhere
    # may retag the name meanwhile; the .id file then differs from the archive at worst until the next build)
  else
    # the archive names the image as the registry would (podman save writes the name it is given)
    podman tag "$id" "$REF"
    podman save -q --format oci-archive -o "$ARCHIVE.tmp" "$REF" >/dev/null
    podman untag "$id" "$REF" 2>/dev/null || true
  fi
  mv -f "$ARCHIVE.tmp" "$ARCHIVE"
  echo "$id" > "$ARCHIVE.id"
  log "exported $ARCHIVE"
fi
size=$(podman image inspect --format '{{.Size}}' "$id")
asize=$(stat -c %s "$ARCHIVE")
printf '%s %s: %d MB (%.1f MiB) uncompressed; archive %s %.1f MiB; %.1fs\n' "$NAME" "${id:0:12}" \
  $(( size / 1000000 )) "$(echo "$size / 1048576" | bc -l)" "$ARCHIVE" "$(echo "$asize / 1048576" | bc -l)" \
  "$(echo "$(date +%s.%N) - $start" | bc -l)"
