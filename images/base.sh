#!/usr/bin/env bash
# The local base image for offline builds: a Debian bookworm root file system made by mmdebstrap from this
# machine's own apt sources (no registry), imported into podman storage. Prints the image name on stdout.
#
# Idempotent: the image's tag carries a hash of this script and the package list, so an unchanged recipe is
# found in storage and not rebuilt (mmdebstrap output is not byte-reproducible, and a new base would
# invalidate every cached layer above it).
#
# The sources are read at run time from `apt-get indextargets` (whatever mirror the machine is configured
# with); they are used for the build only and removed from the image.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"

SUITE=${CB_BASE_SUITE:-bookworm}
ARCH=$(dpkg --print-architecture)
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) ARCH=$2; shift 2 ;;
    *) log "unknown argument $1 (see the header of $0)"; exit 2 ;;
  esac
done
# python3-venv: the build stage makes the venv with it. The rest are the agent's runtime packages.
PACKAGES=python3,python3-venv,ca-certificates,iproute2,iptables,nftables,libnftables1
key=$( { cat "$0"; echo "$SUITE $PACKAGES"; } | sha256sum | cut -c1-12)
# The native base keeps its historical name; another architecture's carries it (both may exist side by side).
if [ "$ARCH" = "$(dpkg --print-architecture)" ]; then
  NAME="localhost/containerboot-py-base:$SUITE-$key"
else
  NAME="localhost/containerboot-py-base:$SUITE-$ARCH-$key"
  foreign_ready "$ARCH"
fi

if podman image exists "$NAME"; then echo "$NAME"; exit 0; fi
command -v mmdebstrap >/dev/null || { log "mmdebstrap is missing: run scripts/setup.sh --image"; exit 1; }

mkdir -p "$IMAGES_CACHE"
tmp=$(mktemp -d "$IMAGES_CACHE/base.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# One "deb" line per configured (site, suite, component) of the requested suite and its -updates/-security.
apt-get indextargets --format '$(TARGET_OF) $(SITE) $(RELEASE) $(COMPONENT)' \
  | awk -v s="$SUITE" '$1 == "deb" && ($3 == s || $3 == s "-updates" || $3 == s "-security") {print "deb " $2 " " $3 " " $4}' \
  | sort -u > "$tmp/sources.list"
[ -s "$tmp/sources.list" ] || { log "no apt source for $SUITE in this machine's apt configuration (apt-get indextargets)"; exit 1; }

log "making the $SUITE $ARCH base with mmdebstrap (about a minute natively, several under emulation)"
start=$(date +%s)
# --variant=essential: Essential packages + ours, no apt (nothing installs packages at run time).
# merged-usr hook: the /usr merge without the usrmerge package, which would pull in perl (about 50 MB).
# Documentation, man pages, translations and glibc's iconv modules are never used by the agent.
mmdebstrap --quiet --variant=essential --format=tar --architectures="$ARCH" \
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
  --include="$PACKAGES" \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/lib/*-linux-gnu/gconv/*' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/etc/apt/sources.list "$1"/etc/apt/sources.list.d/* "$1"/var/log/*' \
  "$SUITE" "$tmp/rootfs.tar" "$tmp/sources.list" >&2
podman import --arch "$ARCH" \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  "$tmp/rootfs.tar" "$NAME" >/dev/null
log "base $NAME made in $(( $(date +%s) - start ))s"
echo "$NAME"
