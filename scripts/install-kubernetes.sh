#!/usr/bin/env bash
# Builds the pinned Kubernetes binaries of the lab's real cluster (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kube-proxy, kubectl), etcd, and two tiny static programs for the lab's own images
# (pause, the Pods' sandbox; lab-echo, an HTTP backend) from the Go module proxy, into a version-keyed cache
# outside the repository. Idempotent: when every binary is there nothing is rebuilt. Prints the directory on
# its last line of stdout (`--print-dir` prints it without building).
#
# Why a module of our own: k8s.io/kubernetes's go.mod replaces its staging modules (k8s.io/api, client-go, ...)
# with ./staging/... directories, which `go install pkg@version` refuses. A module that requires
# k8s.io/kubernetes and replaces each of those staging modules with its published v0.X.Y builds the same code.
# The replace list is read from k8s.io/kubernetes's own go.mod, so a version bump needs no edit here.
set -euo pipefail
. "$(dirname "$0")/gobuild.sh" kubernetes
K8S_VER=${K8S_VER:-v1.34.4}
ETCD_VER=${ETCD_VER:-v3.6.4}
BIN="$CACHE/bin/k8s-$K8S_VER-etcd-$ETCD_VER"
print_only --print-dir "$BIN" "$@"

cmds=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl)
missing=()
for c in "${cmds[@]}" etcd pause lab-echo; do [ -x "$BIN/$c" ] || missing+=("$c"); done
if [ ${#missing[@]} -eq 0 ]; then echo "$BIN"; exit 0; fi

need_go Kubernetes
export GOFLAGS=-mod=mod
SRC="$CACHE/src/k8s-$K8S_VER-etcd-$ETCD_VER"
mkdir -p "$SRC" "$BIN"

# 1. The module: go/godebug lines and the staging replaces copied from k8s.io/kubernetes's go.mod.
if [ ! -f "$SRC/go.sum" ]; then
  log "preparing the build module for Kubernetes $K8S_VER in $SRC"
  kmod=$(cd "$SRC" && go mod download -json "k8s.io/kubernetes@$K8S_VER" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
  [ -f "$kmod" ] || { log "could not download k8s.io/kubernetes $K8S_VER from the module proxy"; exit 1; }
  staging_ver="v0.${K8S_VER#v1.}"
  {
    echo "module containerboot-py.local/kubebuild"
    echo
    grep -E '^(go|godebug) ' "$kmod"
    echo
    echo "require ("
    echo "	k8s.io/kubernetes $K8S_VER"
    echo "	go.etcd.io/etcd/server/v3 $ETCD_VER"
    echo ")"
    echo
    echo "replace ("
    sed -n 's#^[[:space:]]*\(k8s\.io/[^ ]*\) => \./staging/.*#\t\1 => \1 '"$staging_ver"'#p' "$kmod"
    echo ")"
  } >"$SRC/go.mod.new"
  n=$(grep -c "=> k8s.io/.* $staging_ver" "$SRC/go.mod.new" || true)
  [ "$n" -gt 0 ] || { log "no staging replace found in $kmod"; exit 1; }
  mv "$SRC/go.mod.new" "$SRC/go.mod"
  {
    echo "//go:build tools"
    echo
    echo "// Package tools names the commands this module builds, so that go mod tidy keeps their dependencies."
    echo "package tools"
    echo
    echo "import ("
    for c in "${cmds[@]}"; do echo "	_ \"k8s.io/kubernetes/cmd/$c\""; done
    echo "	_ \"go.etcd.io/etcd/server/v3\""
    echo ")"
  } >"$SRC/tools.go"
  log "$n staging modules replaced with $staging_ver; go mod tidy"
  (cd "$SRC" && go mod tidy) >&2
fi

# 2. The binaries, with the version stamps Kubernetes' own build sets (else they report v0.0.0-master).
info=$(cd "$SRC" && go mod download -json "k8s.io/kubernetes@$K8S_VER" | sed -n 's/^[[:space:]]*"Info": "\(.*\)",$/\1/p')
build_date=$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "$info" 2>/dev/null || true)
minor=${K8S_VER#v1.}; minor=${minor%%.*}
ld="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ld+=" -X $pkg.gitVersion=$K8S_VER -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  [ -n "$build_date" ] && ld+=" -X $pkg.buildDate=$build_date"
done
pkgs=()
for c in "${missing[@]}"; do
  case $c in etcd|pause|lab-echo) continue;; esac
  pkgs+=("k8s.io/kubernetes/cmd/$c")
done
if [ ${#pkgs[@]} -gt 0 ]; then
  log "building ${pkgs[*]} (cold: about 9 minutes on 2 cores)"
  (cd "$SRC" && exec go build -trimpath -ldflags="$ld" -o "$BIN/" "${pkgs[@]}") >&2 &
  watch_build $! "Kubernetes $K8S_VER"
fi
if [ ! -x "$BIN/etcd" ]; then
  log "building etcd $ETCD_VER"
  (cd "$SRC" && exec go build -trimpath -ldflags="-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3) >&2 &
  watch_build $! "etcd $ETCD_VER"
fi
# 3. The Pods' sandbox ("pause") program: no registry is reachable, so the pause image is made here from this
# tiny static program (it only waits for SIGTERM/SIGINT, and reaps children as PID 1 of a shared-PID Pod).
if [ ! -x "$BIN/pause" ]; then
  mkdir -p "$SRC/pause"
  cat >"$SRC/pause/main.go" <<'GO'
// Command pause is the sandbox process of the lab's Pods: it holds the Pod's namespaces until it is stopped.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			if pid, _ := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 {
				break
			}
		}
	}
}
GO
  (cd "$SRC" && go build -trimpath -ldflags="-s -w" -o "$BIN/pause" ./pause) >&2
fi
# 4. The backend of the lab's Kubernetes scenarios: a static HTTP server that answers with $MARKER, the peer
# address and the Pod's name (a Deployment of it sits behind a ClusterIP Service).
if [ ! -x "$BIN/lab-echo" ]; then
  mkdir -p "$SRC/labecho"
  cat >"$SRC/labecho/main.go" <<'GO'
// Command lab-echo answers every HTTP request with $MARKER, the request path, the peer and the host name.
package main

import (
	"fmt"
	"net/http"
	"os"
)

func main() {
	port := os.Getenv("PORT")
	if port == "" {
		port = "8080"
	}
	host, _ := os.Hostname()
	marker := os.Getenv("MARKER")
	http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		fmt.Fprintf(w, "%s\npath=%s\npeer=%s\nhost=%s\n", marker, r.URL.RequestURI(), r.RemoteAddr, host)
	})
	if err := http.ListenAndServe(":"+port, nil); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
GO
  (cd "$SRC" && go build -trimpath -ldflags="-s -w" -o "$BIN/lab-echo" ./labecho) >&2
fi
for c in "${cmds[@]}" etcd pause lab-echo; do [ -x "$BIN/$c" ] || { log "$c was not built"; exit 1; }; done
built "Kubernetes $K8S_VER and etcd $ETCD_VER" "$BIN"
