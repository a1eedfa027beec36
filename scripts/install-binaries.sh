#!/usr/bin/env bash
# Builds the pinned real binaries the lab needs (tailscaled, tailscale, upstream containerboot, headscale)
# with `go install` into a version-keyed cache outside the repository. Idempotent: a binary that is already
# there is not rebuilt. Prints the directory on its last line of stdout.
#   --no-upstream   skip upstream containerboot (the reference agent of the conformance tests and benchmarks;
#                   the demo does not run it)
#   --headscale VER only headscale VER (another minor for the version matrix, docs/install-headscale.md), as
#                   $CACHE/bin/headscale-VER; prints that file's path
set -euo pipefail
TS_VER=${TS_VER:-v1.102.3}
HS_VER=${HS_VER:-v0.29.2}
CACHE=${CB_CACHE:-$HOME/.cache/containerboot-py}
BIN="$CACHE/bin/ts-$TS_VER-hs-$HS_VER"
upstream=1
only_hs=""
case "${1:-}" in
  --print-dir) echo "$BIN"; exit 0 ;;
  --no-upstream) upstream=0 ;;
  --headscale) only_hs=${2:?--headscale needs a version, e.g. v0.26.1} ;;
esac
export GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN="$BIN" GOFLAGS=-mod=mod
log() { echo "[install-binaries] $*" >&2; }
. "$(dirname "$0")/progress.sh"

# headscale $1 into the file $2: `go install pkg@version` asks the module proxy for the module's version list
# to check for a deprecation notice, and the proxy here refuses that list for headscale. Downloading the pinned
# version and building inside its (checksummed, read-only) module directory needs no list.
build_headscale() {
  local ver=$1 out=$2 dir start
  log "building headscale $ver (cold build takes several minutes)"
  start=$(date +%s)
  dir=$(go mod download -json "github.com/juanfont/headscale@$ver" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [ -n "$dir" ] || { log "could not download headscale $ver"; exit 1; }
  (cd "$dir" && GOFLAGS=-mod=readonly exec go build -trimpath -ldflags="-s -w" -o "$out.tmp" ./cmd/headscale) &
  watch_build $! "headscale $ver"
  mv "$out.tmp" "$out"
  log "headscale $ver built in $(( $(date +%s) - start ))s"
}

if [ -n "$only_hs" ]; then
  case "$only_hs" in v[0-9]*.[0-9]*.[0-9]*) ;; *) log "--headscale $only_hs: not a version like v0.26.1"; exit 2 ;; esac
  out="$CACHE/bin/headscale-$only_hs"
  mkdir -p "$CACHE/bin"
  [ -x "$out" ] || build_headscale "$only_hs" "$out"
  echo "$out"
  exit 0
fi
mkdir -p "$BIN"
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
[ -x "$BIN/headscale" ] || build_headscale "$HS_VER" "$BIN/headscale"
echo "$BIN"
