#!/usr/bin/env bash
# Builds the lab's container registry, the CNCF registry (distribution v3.0.0, `cmd/registry`: what a homelab
# registry runs), from the Go module proxy into a version-keyed cache outside the repository. Idempotent: when
# the binary is there nothing is rebuilt. Prints the binary's path on its last line of stdout (`--print-path`
# prints it without building).
#
# Built inside the downloaded (checksummed, read-only) module directory, as helm in install-helm.sh. The module
# ships vendor/modules.txt without the vendored sources (module zips leave them out), so the build says
# -mod=readonly: the dependencies come from the module cache, checked against the module's go.sum. The ldflags
# set the variables the project's own release build sets, so `registry --version` names v3.0.0.
set -euo pipefail
. "$(dirname "$0")/gobuild.sh" registry
REGISTRY_VER=${REGISTRY_VER:-v3.0.0}
OUT="$CACHE/bin/registry-$REGISTRY_VER/registry"
print_only --print-path "$OUT" "$@"
cached "$OUT"

need_go "the registry"
json=$(go mod download -json "github.com/distribution/distribution/v3@$REGISTRY_VER")
dir=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$json")
[ -n "$dir" ] && [ -d "$dir" ] || { log "could not download github.com/distribution/distribution/v3 $REGISTRY_VER from the module proxy"; exit 1; }
pkg=github.com/distribution/distribution/v3
ld="-s -w -X $pkg/version.version=$REGISTRY_VER -X $pkg/version.mainpkg=$pkg"
log "building the registry (distribution $REGISTRY_VER; cold: about 2 minutes on 2 cores)"
mkdir -p "$(dirname "$OUT")"
(cd "$dir" && GOFLAGS=-mod=readonly exec go build -trimpath -ldflags="$ld" -o "$OUT.new.$$" ./cmd/registry) >&2 &
watch_build $! "registry $REGISTRY_VER"
mv "$OUT.new.$$" "$OUT"   # a concurrent build of the same pin just replaces it
"$OUT" --version >&2
built "registry $REGISTRY_VER" "$OUT"
