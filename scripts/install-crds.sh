#!/usr/bin/env bash
# Fetches the third-party CRDs the lab installs into its API servers, at a pinned version, from the Go module
# proxy (the module's zip is checksummed by the go command) into a version-keyed cache outside the repository:
# the Prometheus Operator's ServiceMonitor, which a ProxyClass's metrics.serviceMonitor makes
# (netns-tests/test_controller_apiserver.py applies it and checks what the controller creates against its
# schema). Idempotent. Prints the directory on its last line of stdout (`--print-dir` prints it without
# fetching).
set -euo pipefail
. "$(dirname "$0")/gobuild.sh" crds
PROM_OPERATOR_VER=${PROM_OPERATOR_VER:-v0.85.0}
DIR="$CACHE/crds/prometheus-operator-$PROM_OPERATOR_VER"
FILE=monitoring.coreos.com_servicemonitors.yaml
print_only --print-dir "$DIR" "$@"
if [ -s "$DIR/$FILE" ]; then echo "$DIR"; exit 0; fi

need_go "the Prometheus Operator's CRDs"
json=$(GOFLAGS=-mod=mod go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROM_OPERATOR_VER")
src=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$json")
[ -n "$src" ] && [ -s "$src/example/prometheus-operator-crd/$FILE" ] || {
  log "no $FILE in github.com/prometheus-operator/prometheus-operator $PROM_OPERATOR_VER from the module proxy"; exit 1; }
mkdir -p "$DIR"
cp "$src/example/prometheus-operator-crd/$FILE" "$DIR/$FILE.new.$$"
mv "$DIR/$FILE.new.$$" "$DIR/$FILE"
log "the ServiceMonitor CRD of the Prometheus Operator $PROM_OPERATOR_VER fetched in $(( $(date +%s) - _gobuild_start ))s into $DIR"
echo "$DIR"
