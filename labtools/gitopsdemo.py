"""The GitOps variant of the demo (``make demo DEMO_ARGS="--gitops --once"``): Flux installs the controller from a
release in a registry, the way docs/install-gitops.md describes.

Builds the lab (headscale, a ``client`` tailscaled node) and a real cluster with one node in the island, starts
the lab's registry (TLS from a private CA, htpasswd auth) on the node's address with the node's containerd
trusting its CA, runs ``make release`` of the version in VERSION into it (linux/amd64, or
CB_RELEASE_PLATFORMS), starts Flux's source-controller and helm-controller (labtools.fluxlab), applies the
Secrets and the manifests of docs/install-gitops.md (OCIRepository, HelmRelease), then exposes a backend
Service and prints the HelmRelease's Ready condition and a curl from the tailnet client through the proxy.
With ``--once`` it exits after printing: status 0 only if the curl worked.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from labtools import fluxlab, kubecluster, kubecontroller, registry
from labtools import lab as labmod
from labtools.kubedemo import curl_from_client, deploy_backend, hold_open, report_failure
from labtools.lab import Lab, LabError, ensure_binaries

SERVICE = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": "web", "namespace": "demo", "annotations": {"tailscale.com/expose": "true"}},
           "spec": {"type": "LoadBalancer", "selector": {"app": "backend"},
                    "ports": [{"port": 8080, "targetPort": 8080}]}}


def _say(msg: str) -> None:
    print(msg, flush=True)


def run(firewall: str, once: bool, timeout: float = 600.0) -> int:
    t_all = time.monotonic()
    bin_dir = ensure_binaries(upstream=False)
    k8s_bin = kubecluster.ensure_binaries()
    if not registry.binary_path().exists():
        _say("the registry is not built: run scripts/setup.sh --binaries=registry")
        return 2
    if not fluxlab.binaries_present():
        _say("Flux's controllers are not built: run scripts/setup.sh --binaries=flux")
        return 2
    platforms = os.environ.get("CB_RELEASE_PLATFORMS", "linux/amd64")
    ok = False
    with Lab.create(bin_dir=bin_dir, firewall_mode=firewall) as lab, \
            kubecluster.KubeCluster.start(lab=lab, node=True, bin_dir=k8s_bin) as kc, \
            tempfile.TemporaryDirectory(prefix="cbpy-gitops-") as tmp:
        _say(f"lab {lab.prefix} up; cluster API {kc.server}, node Ready {kc.timings['node_ready']:.1f}s after start")
        assert kc.netns is not None
        reg = registry.LabRegistry.start(kc.cfg.run_dir, host=kc.node_ip(kc.nodes[0]), port=5000, netns=kc.netns)
        flux = None
        try:
            kc.trust_registry(reg.address, reg.ca_cert.read_bytes())
            _say(f"registry https://{reg.address} (its CA trusted by the node's containerd, user {reg.username})")
            t0 = time.monotonic()
            rec = fluxlab.make_release(reg, Path(tmp), platforms)
            _say(f"make release {rec['version']} ({platforms}) in {time.monotonic() - t0:.1f}s:")
            for ref in (*rec["images"].values(), f"{rec['chart']['ref']}:{rec['version']}"):
                _say(f"  {ref}")
            t0 = time.monotonic()
            flux = fluxlab.Flux.start(kc)
            _say(f"Flux source-controller and helm-controller running in {fluxlab.FLUX_NS} "
                 f"({time.monotonic() - t0:.1f}s)")
            ok = story(lab, kc, reg, flux, rec["version"], timeout)
            hold_open(kc, k8s_bin, once)
        except (TimeoutError, LabError, kubecluster.ClusterError, fluxlab.FluxError, registry.RegistryError) as e:
            report_failure(kc, e, kubecontroller.controller_log(kc), *([flux.diagnostics()] if flux else []))
        finally:
            if flux is not None:
                flux.close()
            reg.close()
    _say(f"done in {time.monotonic() - t_all:.1f}s; everything torn down")
    return 0 if ok else 1


def story(lab: Lab, kc: kubecluster.KubeCluster, reg: registry.LabRegistry, flux: fluxlab.Flux, version: str,
          timeout: float) -> bool:
    src = fluxlab.Source(registry=reg.address, path="tailscale", version=version,
                         headscale_url=labmod.LOGIN_SERVER, magic_dns_suffix="tailnet.test",
                         extra_values={"proxy": {"firewallMode": lab.firewall_mode,
                                                 "env": kubecontroller.LAB_PROXY_ENV}})
    objs = fluxlab.gitops_manifests(src)
    key = lab.hs("apikeys", "create", "--expiration", "2h")
    key = key if isinstance(key, str) else str((key or {}).get("key") or key)
    kc.apply([objs[0], *fluxlab.secrets_manifests(src.namespace, reg, key)])
    kc.apply(objs)
    _say(f"applied: Namespace {src.namespace}, Secrets regcred, registry-ca, headscale-api-key, "
         f"OCIRepository and HelmRelease {fluxlab.RELEASE} (tag {version})")
    t0 = time.monotonic()
    hr = fluxlab.wait_release_ready(kc, src.namespace, fluxlab.RELEASE, version, timeout)
    _say(f"HelmRelease {src.namespace}/{fluxlab.RELEASE} after {time.monotonic() - t0:.1f}s: "
         f"{json.dumps(fluxlab.condition(hr))}")
    kc.kubectl("-n", src.namespace, "rollout", "status", "deployment/tailscale-controller", "--timeout=300s",
               timeout=310)
    _say(kc.kubectl("-n", src.namespace, "get", "deploy,pods", "-o", "wide").stdout.rstrip())
    marker = deploy_backend(kc, lab)
    kc.apply(SERVICE)
    svc = kubecontroller.wait_service_ip(kc, "demo", "web", 300)
    ip = kubecontroller.lb_ips(svc)[0]
    host = svc["status"]["loadBalancer"]["ingress"][0].get("hostname", "")
    _say(f"Service demo/web exposed: {json.dumps(svc['status'])}")
    lab.wait_peer("client", host.split(".")[0] or "demo-web", 60)
    curl_from_client(lab, ip, "/demo-gitops", marker, f"{host}, the proxy pulled from {reg.address}")
    return True
