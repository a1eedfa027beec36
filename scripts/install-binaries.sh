#!/usr/bin/env bash
# Builds the pinned real binaries the lab needs (tailscaled, tailscale, upstream containerboot, headscale)
# with `go install` into a version-keyed cache outside the repository. Idempotent: a binary that is already
# there is not rebuilt. Prints the directory on its last line of stdout.
#   --no-upstream   skip upstream containerboot (the reference agent of the conformance tests and benchmarks;
#                   the demo does not run it)
set -euo pipefail
TS_VER=${TS_VER:-v1.102.3}
HS_VER=${HS_VER:-v0.29.2}
CACHE=${CB_CACHE:-$HOME/.cache/containerboot-py}
BIN="$CACHE/bin/ts-$TS_VER-hs-$HS_VER"
upstream=1
case "${1:-}" in
  --print-dir) echo "$BIN"; exit 0 ;;
  --no-upstream) upstream=0 ;;
esac
mkdir -p "$BIN"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN="$BIN" GOFLAGS=-mod=mod
log() { echo "[install-binaries] $*" >&2; }
. "$(dirname "$0")/progress.sh"
need=()
wanted=(tailscaled tailscale)
[ $upstream = 1 ] && wanted+=(containerboot)
for b in "${wanted[@]}"; do [ -x "$BIN/$b" ] || need+=("tailscale.com/cmd/$b@$TS_VER"); done
if [ ${#need[@]} -gt 0 ]; then
  log "building ${need[*]} (cold build takes several minutes)"
  start=$(date +%s)
  go install -trimpath \
    -ldflags="-s -w -X tailscale.com/version.longStamp=${TS_VER#v}-cbpy -X tailscale.com/version.shortStamp=${TS_VER#v}" \
    "${need[@]}" &
  watch_build $! "tailscale $TS_VER"
  log "tailscale binaries built in $(( $(date +%s) - start ))s"
fi
if [ ! -x "$BIN/headscale" ]; then
  log "building headscale $HS_VER (cold build takes several minutes)"
  start=$(date +%s)
  # `go install pkg@version` asks the module proxy for the module's version list to check for a
  # deprecation notice, and the proxy here refuses that list for headscale. Downloading the pinned version
  # and building inside its (checksummed, read-only) module directory needs no list.
  dir=$(go mod download -json "github.com/juanfont/headscale@$HS_VER" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [ -n "$dir" ] || { log "could not download headscale $HS_VER"; exit 1; }
  (cd "$dir" && GOFLAGS=-mod=readonly exec go build -trimpath -ldflags="-s -w" -o "$BIN/headscale" ./cmd/headscale) &
  watch_build $! "headscale $HS_VER"
  log "headscale built in $(( $(date +%s) - start ))s"
fi
echo "$BIN"
