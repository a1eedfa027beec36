#!/usr/bin/env bash
# Idempotent set-up for the demo and the tests: Debian packages, the Python venv, and (with --binaries) the
# pinned Go-built binaries. Each step is skipped when already done. Progress goes to stderr.
#   --binaries                  what `make test` needs: tailscale (tailscaled, tailscale, headscale), upstream
#                               (upstream containerboot, the tests' reference agent), kubernetes (Kubernetes,
#                               etcd, CoreDNS and the node's Debian packages), helm, registry (the lab's container
#                               registry, with Apache's htpasswd for its users) and browser (Debian's chromium and
#                               its driver, for the recorder's replay page test)
#   --binaries=flux,cert-manager
#                               the other projects' controllers `make test-ecosystem` runs: Flux's
#                               source-controller and helm-controller with their CRDs and RBAC (the GitOps test
#                               and demo) and cert-manager v1.19.1 (the HTTPS test and demo); about an hour of
#                               Go builds cold, hence not part of --binaries
#   --binaries=tailscale,...    only those parts (the plain `make demo` needs tailscale alone)
#   --image                     podman, runc and mmdebstrap for images/build.sh
#   --multiarch                 qemu user mode for other architectures' images
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "[setup] $*" >&2; }

want_image=0 want_multiarch=0 parts=""
for a in "$@"; do
  case "$a" in
    --binaries) parts=tailscale,upstream,kubernetes,helm,registry,browser ;;
    --binaries=*) parts=${a#--binaries=} ;;
    --image) want_image=1 ;;
    --multiarch) want_multiarch=1 ;;  # qemu user mode for other architectures' images (make images-archives)
    *) log "unknown option $a"; exit 2 ;;
  esac
done
want() { [[ ",$parts," == *",$1,"* ]]; }

# 1. Debian packages the agent and the lab use.
pkgs=(iproute2 nftables iptables libnftables1 curl dnsmasq-base openssl python3-venv procps)
# the real Kubernetes node of the lab (labtools/kubecluster.py): container runtime, OCI runtime, CNI plugins
want kubernetes && pkgs+=(containerd runc containernetworking-plugins)
# a real browser for the recorder's replay page (tests/test_recorder_browser.py, driven by selenium)
want browser && pkgs+=(chromium chromium-driver)
want registry && pkgs+=(apache2-utils)
[ $want_image = 1 ] && pkgs+=(podman runc mmdebstrap bc)
[ $want_multiarch = 1 ] && pkgs+=(qemu-user-static)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing Debian packages ${missing[*]} and not root: install them with apt-get"; exit 1
  fi
  log "installing Debian packages: ${missing[*]}"
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
fi

# 2. The venv with the project and its test dependencies (re-installed when pyproject.toml changes).
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating the Python venv in .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  log "installing Python packages into .venv"
  .venv/bin/pip install -q --upgrade pip >&2
  .venv/bin/pip install -q -e '.[test,controller]' >&2
  rm -f .venv/.installed-*; touch "$stamp"
fi

# 3. tailscaled, tailscale, upstream containerboot, headscale, Kubernetes, helm and CoreDNS, built once into a cache outside
#    the repo.
if [ -n "$parts" ]; then
  if command -v go >/dev/null 2>&1; then
    if want tailscale; then
      if want upstream; then up=(); else up=(--no-upstream); fi
      bash scripts/install-binaries.sh "${up[@]}" >/dev/null || log "building the binaries failed; the end-to-end tests will be skipped"
    fi
    # Kubernetes v1.34.4 + etcd for the real-cluster tests and `make demo DEMO_ARGS=--kube` (about 9 min cold)
    if want kubernetes; then
      bash scripts/install-kubernetes.sh >/dev/null || log "building Kubernetes failed; the real-cluster tests will be skipped"
    fi
    # helm v3.19.0 for the controller's chart (charts/tailscale-controller; about 2 min cold)
    if want helm; then
      bash scripts/install-helm.sh >/dev/null || log "building helm failed; the chart tests will be skipped"
    fi
    # CoreDNS v1.12.1, the lab cluster's DNS (labtools/coredns.py; about 5 min cold); the Prometheus Operator's
    # ServiceMonitor CRD for the controller's test against a real API server (seconds)
    if want kubernetes; then
      bash scripts/install-coredns.sh >/dev/null || log "building CoreDNS failed; the lab cluster will have no DNS"
      bash scripts/install-crds.sh >/dev/null || log "fetching the ServiceMonitor CRD failed; its test will be skipped"
    fi
    # cert-manager v1.19.1's controller, webhook and cainjector in one program, its CRDs and chart
    # (labtools/certmanager.py; about 48 minutes cold on a busy 2-core machine)
    if want cert-manager; then
      bash scripts/install-cert-manager.sh >/dev/null || log "building cert-manager failed; its tests will be skipped"
    fi
    # the CNCF registry v3.0.0, the lab's container registry (labtools/registry.py; about 2 min cold)
    if want registry; then
      bash scripts/install-registry.sh >/dev/null || log "building the registry failed; the registry tests will be skipped"
    fi
    # Flux's source-controller v1.7.0 and helm-controller v1.4.0, run by the lab's GitOps test and demo
    # (labtools/fluxlab.py; 17 to 70 min cold on a 2-core machine, as busy as it is: docs/lab-and-tests.md)
    if want flux; then
      bash scripts/install-flux.sh >/dev/null || log "building Flux's controllers failed; the GitOps test will be skipped"
    fi
  else
    log "no Go toolchain: the end-to-end tests will be skipped"
  fi
fi
