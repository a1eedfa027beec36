#!/usr/bin/env bash
# Builds the lab cluster's DNS server, CoreDNS, at the version kubeadm deploys with the lab's Kubernetes, from
# the Go module proxy into a version-keyed cache outside the repository. Idempotent: when the binary is there
# nothing is rebuilt. Prints the binary's path on its last line of stdout (`--print-path` prints it without
# building).
#
# A module of our own with CoreDNS's own main (coremain) and only the plugins the lab's Corefiles use, in
# CoreDNS's plugin order: the cloud provider plugins of the full build would add minutes of downloads and
# compilation for nothing.
set -euo pipefail
. "$(dirname "$0")/gobuild.sh" coredns
COREDNS_VER=${COREDNS_VER:-v1.12.1}
OUT="$CACHE/bin/coredns-$COREDNS_VER/coredns"
print_only --print-path "$OUT" "$@"
cached "$OUT"

need_go CoreDNS
export GOFLAGS=-mod=mod
SRC="$CACHE/src/coredns-$COREDNS_VER"
mkdir -p "$SRC" "$(dirname "$OUT")"
cat >"$SRC/main.go" <<'GO'
// Command coredns is CoreDNS with the plugins a Kubernetes cluster's DNS uses (kubeadm's Corefile) plus hosts.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/hosts"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

// The order in which plugins handle a query: CoreDNS's own (plugin.cfg), restricted to those above.
var directives = []string{
	"reload", "ready", "health", "errors", "log", "loadbalance", "cache", "hosts", "kubernetes", "loop", "forward",
}

func init() { dnsserver.Directives = directives }

func main() { coremain.Run() }
GO
if [ ! -f "$SRC/go.mod" ]; then
  (cd "$SRC" && go mod init labcoredns && go get "github.com/coredns/coredns@$COREDNS_VER") >&2
fi
log "building CoreDNS $COREDNS_VER (cold: about 5 minutes on 2 cores)"
(cd "$SRC" && go mod tidy && exec go build -trimpath -ldflags="-s -w" -o "$OUT" .) >&2 &
watch_build $! "CoreDNS $COREDNS_VER"
"$OUT" -version >&2
built "CoreDNS $COREDNS_VER" "$OUT"
