#!/usr/bin/env bash
# The local TAILSCALE_IMAGE for offline builds (see tailscale-local.Containerfile). Prints its name.
# Idempotent: tagged with the binaries' hash, so unchanged binaries are not re-imported.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"
bin=$(bash "$here/../scripts/install-binaries.sh" --print-dir)
for b in tailscaled tailscale; do
  [ -x "$bin/$b" ] || { log "$bin/$b is missing: run make setup-bin"; exit 1; }
done
ver=$(basename "$bin" | sed -n 's/^ts-\(v[^-]*\)-.*/\1/p')
key=$(cat "$bin/tailscaled" "$bin/tailscale" "$here/tailscale-local.Containerfile" | sha256sum | cut -c1-12)
NAME="localhost/containerboot-py-tailscale:${ver:-local}-$key"
if podman image exists "$NAME"; then echo "$NAME"; exit 0; fi
mkdir -p "$IMAGES_CACHE"
tmp=$(mktemp -d "$IMAGES_CACHE/ts.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
cp "$bin/tailscaled" "$bin/tailscale" "$here/tailscale-local.Containerfile" "$tmp/"
pod build -q -f "$tmp/tailscale-local.Containerfile" -t "$NAME" "$tmp" >/dev/null
log "tailscale image $NAME made from $bin"
echo "$NAME"
