#!/usr/bin/env bash
# Builds cert-manager v1.19.1 (github.com/cert-manager/cert-manager) from the Go module proxy into a
# version-keyed cache outside the repository: one static program, `cert-manager controller|webhook|
# cainjector` (scripts/certmanager/main.go), with the module's CRDs (deploy/crds) and its Helm chart
# (deploy/charts/cert-manager, Chart.yaml written from the module's Chart.template.yaml with the version).
# Idempotent: when the binary is there nothing is rebuilt. Prints the directory on its last line of stdout
# (`--print-dir` prints it without building).
#
# cert-manager's commands (cmd/controller, cmd/webhook, cmd/cainjector) are Go modules of their own that are
# not tagged, so the module proxy does not serve them: scripts/certmanager is the small main that drives the
# published module's packages, checked by its go.sum like any other dependency. The cache key includes a hash
# of that directory, so a changed main is rebuilt. The ldflags set the version the module reports.
set -euo pipefail
. "$(dirname "$0")/gobuild.sh" cert-manager
CM_VER=${CM_VER:-v1.19.1}
SRC="$(cd "$(dirname "$0")/certmanager" && pwd)"
key=$(cat "$SRC/go.mod" "$SRC/go.sum" "$SRC/main.go" | sha256sum | cut -c1-12)
DIR="$CACHE/bin/cert-manager-$CM_VER-$key"
print_only --print-dir "$DIR" "$@"
if [ -x "$DIR/cert-manager" ] && [ -d "$DIR/crds" ] && [ -f "$DIR/chart/Chart.yaml" ]; then echo "$DIR"; exit 0; fi

need_go "cert-manager"
grep -q "github.com/cert-manager/cert-manager $CM_VER\$" "$SRC/go.mod" \
  || { log "scripts/certmanager/go.mod does not require cert-manager $CM_VER"; exit 1; }
json=$(go mod download -json "github.com/cert-manager/cert-manager@$CM_VER")
dir=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$json")
[ -n "$dir" ] && [ -d "$dir" ] || { log "could not download github.com/cert-manager/cert-manager $CM_VER from the module proxy"; exit 1; }
mkdir -p "$DIR/crds"
install -m 0644 "$dir"/deploy/crds/*.yaml "$DIR/crds/"
rm -rf "$DIR/chart"; cp -r "$dir/deploy/charts/cert-manager" "$DIR/chart"; chmod -R u+w "$DIR/chart"
sed -e "s/^version: .*/version: $CM_VER/" -e "s/^appVersion: .*/appVersion: $CM_VER/" \
    -e 's/{{IS_PRERELEASE}}/false/' "$DIR/chart/Chart.template.yaml" >"$DIR/chart/Chart.yaml"
pkg=github.com/cert-manager/cert-manager/pkg/util
log "building cert-manager $CM_VER (controller, webhook, cainjector in one program)"
(cd "$SRC" && GOFLAGS=-mod=readonly exec go build -trimpath -ldflags="-s -w -X $pkg.AppVersion=$CM_VER" \
  -o "$DIR/cert-manager.new.$$" .) >&2 &
watch_build $! "cert-manager $CM_VER"
mv "$DIR/cert-manager.new.$$" "$DIR/cert-manager"
built "cert-manager $CM_VER" "$DIR"
