"""controller.podsecurity and the reconciler: a proxies' namespace whose Pod Security level refuses the proxy's
Pod gives the parent a False condition and a Warning event naming the label to set, and nothing is created."""
from __future__ import annotations

from controller import podsecurity, render
from controller.config import ControllerConfig
from controller.kubeapi import EVENTS, NAMESPACES, SECRETS, SERVICES, STATEFULSETS
from controller.model import INGRESS, SVC, Parent, ProxySpec
from controller.reconcile import POD_SECURITY_RECHECK, REASON_POD_SECURITY, Reconciler
from tests.support.fakekube import FakeKube, FakeProvider

CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.local/proxy:1",
                       login_server="http://hs.test:8080")
LABEL = "pod-security.kubernetes.io/enforce"


def ns(level: str | None) -> dict:
    return {"metadata": {"name": "tailscale", "labels": {LABEL: level} if level else {}}}


def pod_spec(userspace: bool) -> dict:
    spec = ProxySpec(parent=Parent(SVC if not userspace else INGRESS, "web", "apps", "u1"), hostname="web",
                     tags=("tag:k8s",), app="k8s-operator-service", userspace=userspace)
    return render.statefulset(spec, CFG)["spec"]["template"]["spec"]


def test_kernel_proxy_admitted_only_by_privileged():
    assert podsecurity.refusal(ns("privileged"), pod_spec(False)) is None
    assert podsecurity.refusal(ns(None), pod_spec(False)) is None        # the cluster's default: unknown
    r = podsecurity.refusal(ns("baseline"), pod_spec(False))
    assert r is not None and r.level == "baseline"
    assert r.violations == ("container 'sysctler' is privileged", "container 'tailscale' is privileged")


def test_userspace_proxy_passes_baseline_not_restricted():
    assert podsecurity.refusal(ns("baseline"), pod_spec(True)) is None
    r = podsecurity.refusal(ns("restricted"), pod_spec(True))
    assert r is not None and "container 'tailscale' does not set runAsNonRoot=true" in r.violations
    msg = r.message("tailscale", userspace=True)
    assert f"kubectl label namespace tailscale {LABEL}=baseline --overwrite" in msg


def test_unknown_level_is_restricted_and_capabilities_count():
    assert podsecurity.enforced_level(ns("strict")) == "restricted"
    spec = {"containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["NET_ADMIN", "CHOWN"]}}}]}
    r = podsecurity.refusal(ns("baseline"), spec)
    assert r is not None and r.violations == ("container 'c' adds capabilities NET_ADMIN",)


async def test_refused_namespace_creates_nothing_and_says_which_label():
    log: list = []
    kube, prov = FakeKube(log), FakeProvider(log)
    rec = Reconciler(kube, prov, CFG, now=lambda: "2026-01-01T00:00:00Z")
    kube.put(NAMESPACES, ns("restricted"))
    kube.put(SERVICES, {"metadata": {"name": "web", "namespace": "apps",
                                     "annotations": {"tailscale.com/expose": "true"}},
                        "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"]}})
    assert await rec.reconcile("svc", "apps", "web") == POD_SECURITY_RECHECK
    assert prov.keys == [] and kube.of(STATEFULSETS) == [] and kube.of(SECRETS) == []
    c = next(c for c in kube.obj(SERVICES, "web", "apps")["status"]["conditions"]
             if c["type"] == "TailscaleProxyReady")
    assert c["status"] == "False" and c["reason"] == "ProxyFailed"
    assert f"kubectl label namespace tailscale {LABEL}=privileged --overwrite" in c["message"]
    assert "'restricted'" in c["message"] and "not ready" not in c["message"]
    [ev] = kube.of(EVENTS)
    assert ev["reason"] == REASON_POD_SECURITY and ev["type"] == "Warning" and ev["message"] == c["message"]
    # a second pass sends no second event; the label set, the next pass creates the proxy
    await rec.reconcile("svc", "apps", "web")
    assert len(kube.of(EVENTS)) == 1
    kube.put(NAMESPACES, ns("privileged"))
    await rec.reconcile("svc", "apps", "web")
    assert len(kube.of(STATEFULSETS)) == 1 and len(prov.keys) == 1
    c = next(c for c in kube.obj(SERVICES, "web", "apps")["status"]["conditions"]
             if c["type"] == "TailscaleProxyReady")
    assert c["reason"] == "ProxyPending"
