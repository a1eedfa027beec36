#!/usr/bin/env bash
# The local TAILSCALE_IMAGE for offline builds (see tailscale-local.Containerfile). Prints its name.
#
# It holds one binary: tailscaled v1.102.3 built from the same module as scripts/install-binaries.sh, with the
# tag ts_include_cli (tailscaled runs as the CLI when called as `tailscale`, so the Dockerfile links
# tailscale to it) and without the features a proxy Pod never uses (ts_omit_*, below): 29 MB instead of
# 53 MB for the two separate binaries. CB_IMAGE_FULL_TAILSCALE=1 uses the two regular binaries instead.
# Idempotent: the binary is built once into the binaries' cache; the image is tagged with its hash.
#
#   bash images/tailscale.sh --arch arm64   # for another architecture: tailscaled cross-compiled (GOARCH), no
#                                           # emulation needed (pure Go, CGO off)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"
ARCH=$(dpkg --print-architecture)
NATIVE=$ARCH
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) ARCH=$2; shift 2 ;;
    *) log "unknown argument $1 (see the header of $0)"; exit 2 ;;
  esac
done
bin=$(bash "$here/../scripts/install-binaries.sh" --print-dir)
ver=$(basename "$bin" | sed -n 's/^ts-\(v[^-]*\)-.*/\1/p')
ver=${ver:-v1.102.3}

# Desktop, NAS and workstation features (file sharing, system tray, D-Bus/NetworkManager/resolved DNS
# managers, self-update, shell completion, QR codes, browser, BIRD, TAP, Wake-on-LAN, packet capture, TPM,
# systemd notify, the web client, `tailscale bugreport/doctor`): none is reachable through containerboot's
# settings in a proxy Pod. Kubernetes state, serve, netstack, SSH, exit nodes and routes, tailnet lock, app
# connectors, AWS parameter-store keys and everything else stay.
TAGS="ts_include_cli ts_omit_drive ts_omit_taildrop ts_omit_systray ts_omit_desktop_sessions ts_omit_dbus
ts_omit_networkmanager ts_omit_resolved ts_omit_synology ts_omit_flashappliance ts_omit_clientupdate
ts_omit_completion ts_omit_completion_scripts ts_omit_qrcodes ts_omit_colorable ts_omit_webbrowser ts_omit_bird
ts_omit_tap ts_omit_wakeonlan ts_omit_capture ts_omit_tpm ts_omit_sdnotify ts_omit_linuxdnsfight
ts_omit_doctor ts_omit_webclient"
TAGS=$(echo $TAGS | tr ' ' ',')

ctx=$(mktemp -d "${TMPDIR:-/tmp}/cbpy-ts.XXXXXX")
trap 'rm -rf "$ctx"' EXIT
if [ "$ARCH" != "$NATIVE" ] && ! command -v go >/dev/null 2>&1; then
  log "building tailscaled for $ARCH needs a Go toolchain (it is cross-compiled)"; exit 1
fi
if [ "$ARCH" = "$NATIVE" ] && { [ "${CB_IMAGE_FULL_TAILSCALE:-0}" = 1 ] || ! command -v go >/dev/null 2>&1; }; then
  [ "${CB_IMAGE_FULL_TAILSCALE:-0}" = 1 ] || log "no Go toolchain: the image gets the two regular binaries"
  for b in tailscaled tailscale; do
    [ -x "$bin/$b" ] || { log "$bin/$b is missing: run make setup-bin"; exit 1; }
    cp "$bin/$b" "$ctx/"
  done
else
  slim="$bin/tailscaled-image-$(echo "$TAGS" | sha256sum | cut -c1-8)"
  [ "$ARCH" = "$NATIVE" ] || slim="$slim-$ARCH"
  if [ ! -x "$slim" ]; then
    log "building tailscaled $ver with the CLI included and unused features left out (about 2 minutes)"
    start=$(date +%s)
    gobin=$(mktemp -d "${TMPDIR:-/tmp}/cbpy-gobin.XXXXXX")
    # A GOPATH of its own (the module cache stays the shared one): go install puts a cross-compiled binary in
    # GOPATH/bin/linux_<arch>/ and refuses GOBIN for it.
    GOTOOLCHAIN=local CGO_ENABLED=0 GOOS=linux GOARCH="$ARCH" GOPATH="$gobin" GOMODCACHE="$(go env GOMODCACHE)" \
      GOBIN= GOFLAGS=-mod=mod go install -trimpath -tags "$TAGS" \
      -ldflags="-s -w -X tailscale.com/version.longStamp=${ver#v}-cbpy -X tailscale.com/version.shortStamp=${ver#v}" \
      "tailscale.com/cmd/tailscaled@$ver" >&2
    out=$(find "$gobin/bin" -name tailscaled -type f | head -1)
    # another TAILSCALE_VERSION's binaries directory may not exist yet (install-binaries.sh made only its own)
    mkdir -p "$(dirname "$slim")"
    mv "$out" "$slim.tmp"
    mv "$slim.tmp" "$slim"
    chmod -R u+w "$gobin" 2>/dev/null; rm -rf "$gobin"
    log "built $slim in $(( $(date +%s) - start ))s"
  fi
  cp "$slim" "$ctx/tailscaled"
fi
cp "$here/tailscale-local.Containerfile" "$ctx/"
key=$(cd "$ctx" && cat * | sha256sum | cut -c1-12)
NAME="localhost/containerboot-py-tailscale:$ver-$key"
if podman image exists "$NAME"; then echo "$NAME"; exit 0; fi
pod build -q --platform "linux/$ARCH" -f "$ctx/tailscale-local.Containerfile" -t "$NAME" "$ctx" >/dev/null
log "tailscale image $NAME made"
echo "$NAME"
