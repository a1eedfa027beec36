#!/usr/bin/env bash
# Builds Flux's source-controller v1.7.0 and helm-controller v1.4.0 from the Go module proxy into a
# version-keyed cache outside the repository, with their CRDs (each module's config/crd/bases) and their RBAC
# (config/rbac: the manager's ClusterRole and the leader election Role, as rbac/<controller>-*.yaml).
# Idempotent: when both binaries are there nothing is rebuilt. Prints the directory on its last line of stdout
# (`--print-dir` prints it without building). `scripts/setup.sh --binaries` (part `flux`) runs it.
#
# labtools/fluxlab.py runs the two controllers in the lab (docs/install-gitops.md, "Flux"). Each module
# replaces its own API module with `./api`, a nested module that module zips leave out; so each is copied out
# of the (read-only) module cache into a source directory of its own and the replace points at the published
# API module of the same version, checked by go.sum like any other.
set -euo pipefail
. "$(dirname "$0")/gobuild.sh" flux
SC_VER=${SC_VER:-v1.7.0}
HC_VER=${HC_VER:-v1.4.0}
DIR="$CACHE/bin/flux-sc-$SC_VER-hc-$HC_VER"
print_only --print-dir "$DIR" "$@"
if [ -x "$DIR/source-controller" ] && [ -x "$DIR/helm-controller" ] && [ -d "$DIR/crds" ] && [ -d "$DIR/rbac" ]; then
  echo "$DIR"; exit 0
fi

need_go "Flux's controllers"
mkdir -p "$DIR/crds" "$DIR/rbac"
build() {  # module version binary
  local mod=$1 ver=$2 bin=$3 json dir src t0
  t0=$(date +%s)
  json=$(go mod download -json "$mod@$ver")
  dir=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$json")
  [ -n "$dir" ] && [ -d "$dir" ] || { log "could not download $mod $ver from the module proxy"; exit 1; }
  install -m 0644 "$dir"/config/crd/bases/*.yaml "$DIR/crds/"
  install -m 0644 "$dir/config/rbac/role.yaml" "$DIR/rbac/$bin-role.yaml"
  install -m 0644 "$dir/config/rbac/leader_election_role.yaml" "$DIR/rbac/$bin-leader-election-role.yaml"
  # a binary built earlier (before the RBAC files were kept) is not rebuilt
  if [ -x "$DIR/$bin" ]; then return 0; fi
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
