#!/usr/bin/env bash
# Builds Flux's source-controller v1.7.0 and helm-controller v1.4.0 from the Go module proxy into a
# version-keyed cache outside the repository, with their CRDs (each module's config/crd/bases). Idempotent:
# when both binaries are there nothing is rebuilt. Prints the directory on its last line of stdout
# (`--print-dir` prints it without building).
#
# Not used by any test or demo yet: it is the build step of running Flux in the lab (docs/install-gitops.md,
# "Flux", says what is left). Each module replaces its own API module with `./api`, a nested module that module
# zips leave out; so each is copied out of the (read-only) module cache into a source directory of its own
# and the replace points at the published API module of the same version, checked by go.sum like any other.
set -euo pipefail
. "$(dirname "$0")/gobuild.sh" flux
SC_VER=${SC_VER:-v1.7.0}
HC_VER=${HC_VER:-v1.4.0}
DIR="$CACHE/bin/flux-sc-$SC_VER-hc-$HC_VER"
print_only --print-dir "$DIR" "$@"
if [ -x "$DIR/source-controller" ] && [ -x "$DIR/helm-controller" ] && [ -d "$DIR/crds" ]; then echo "$DIR"; exit 0; fi

need_go "Flux's controllers"
mkdir -p "$DIR/crds"
build() {  # module version binary
  local mod=$1 ver=$2 bin=$3 json dir src t0
  t0=$(date +%s)
  json=$(go mod download -json "$mod@$ver")
  dir=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$json")
  [ -n "$dir" ] && [ -d "$dir" ] || { log "could not download $mod $ver from the module proxy"; exit 1; }
  install -m 0644 "$dir"/config/crd/bases/*.yaml "$DIR/crds/"
  src="$CACHE/src/$bin-$ver"
  rm -rf "$src"; mkdir -p "$(dirname "$src")"
  cp -r "$dir" "$src"; chmod -R u+w "$src"
  (cd "$src" && go mod edit -replace "$mod/api=$mod/api@$ver" && GOFLAGS=-mod=mod go mod download "$mod/api@$ver") >&2
  log "building $bin $ver"
  (cd "$src" && GOFLAGS=-mod=mod exec go build -trimpath -ldflags="-s -w" -o "$DIR/$bin.new.$$" .) >&2 &
  watch_build $! "$bin $ver"
  mv "$DIR/$bin.new.$$" "$DIR/$bin"
  log "$bin $ver built in $(( $(date +%s) - t0 ))s"
}
build github.com/fluxcd/source-controller "$SC_VER" source-controller
build github.com/fluxcd/helm-controller "$HC_VER" helm-controller
built "source-controller $SC_VER and helm-controller $HC_VER" "$DIR"
