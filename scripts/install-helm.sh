#!/usr/bin/env bash
# Builds the pinned helm (the chart in charts/tailscale-controller is linted, rendered and installed with it) from the Go
# module proxy into a version-keyed cache outside the repository. Idempotent: when the binary is there nothing
# is rebuilt. Prints the directory on its last line of stdout (`--print-dir` prints it without building).
#
# Built inside the downloaded (checksummed, read-only) module directory, as headscale in install-binaries.sh:
# `go install pkg@version` asks the proxy for the module's version list, which is not needed for a pin. The
# ldflags set the variables helm's own release build sets, so `helm version` says v3.19.0 (not "v3.19") and
# `helm lint` checks API deprecations against the Kubernetes minor helm was built with (from its go.mod).
set -euo pipefail
. "$(dirname "$0")/gobuild.sh" helm
HELM_VER=${HELM_VER:-v3.19.0}
BIN="$CACHE/bin/helm-$HELM_VER"
print_only --print-dir "$BIN" "$@"
cached "$BIN/helm" "$BIN"

need_go helm
json=$(go mod download -json "helm.sh/helm/v3@$HELM_VER")
dir=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$json")
[ -n "$dir" ] && [ -d "$dir" ] || { log "could not download helm.sh/helm/v3 $HELM_VER from the module proxy"; exit 1; }
# the Kubernetes version helm's lint checks against: client-go v0.X.Y -> 1.X, as helm's Makefile derives it
kmin=$(sed -n 's/^[[:space:]]*k8s\.io\/client-go v0\.\([0-9]*\)\..*/\1/p' "$dir/go.mod")
[ -n "$kmin" ] || { log "no k8s.io/client-go in $dir/go.mod"; exit 1; }
ld="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VER -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for p in pkg/lint/rules pkg/chartutil; do
  ld+=" -X helm.sh/helm/v3/$p.k8sVersionMajor=1 -X helm.sh/helm/v3/$p.k8sVersionMinor=$kmin"
done
log "building helm $HELM_VER (cold: about 2 minutes on 2 cores)"
mkdir -p "$BIN"
(cd "$dir" && GOFLAGS=-mod=readonly exec go build -trimpath -ldflags="$ld" -o "$BIN/helm.new.$$" ./cmd/helm) >&2 &
watch_build $! "helm $HELM_VER"
mv "$BIN/helm.new.$$" "$BIN/helm"   # a concurrent build of the same pin just replaces it
[ "$("$BIN/helm" version --short)" = "$HELM_VER" ] || { log "built helm reports $("$BIN/helm" version --short), not $HELM_VER"; exit 1; }
built "helm $HELM_VER" "$BIN"
