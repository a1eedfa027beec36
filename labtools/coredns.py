"""CoreDNS as the lab cluster's DNS, deployed the way real clusters run it (kubeadm's objects).

The binary is built from the Go module proxy by scripts/install-coredns.sh (pinned, cached) and put into a
one-file image (``labtools.ociimage``) imported into the node's containerd: the lab has no registry. The
objects are kubeadm's: ServiceAccount ``coredns``, ClusterRole ``system:coredns``, ConfigMap ``coredns`` with
the ``Corefile``, Deployment ``coredns`` and Service ``kube-dns`` at the kubelet's ``clusterDNS`` address (the
tenth address of the Service range, as kubeadm picks it), all in ``kube-system``.

Two lab differences from kubeadm's Corefile, on purpose: no ``forward . /etc/resolv.conf`` and no ``loop``
(the lab has no upstream resolver: the node's resolv.conf names 127.0.0.1, which in CoreDNS's own Pod is
CoreDNS itself, the loop the ``loop`` plugin would stop it for), and ``reload 2s`` instead of the default 30 s,
so a test that edits the Corefile (the controller's stub zone) waits seconds, not half a minute.

API::

    ensure_binary()                      # the coredns binary, built first when missing
    cluster_dns_ip("10.96.0.0/16")       # "10.96.0.10"
    corefile("cluster.local")            # the Corefile text
    manifests(dns_ip, "cluster.local")   # the objects, for KubeCluster.apply
    image_archive_path()                 # the OCI archive of IMAGE (cached next to the binary)
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from pathlib import Path

from labtools import ociimage

REPO_ROOT = Path(__file__).resolve().parent.parent
INSTALL_SCRIPT = REPO_ROOT / "scripts" / "install-coredns.sh"
COREDNS_VER = os.environ.get("COREDNS_VER", "v1.12.1")
IMAGE = "localhost/coredns:lab"
NAMESPACE = "kube-system"
CONFIGMAP = "coredns"
SERVICE = "kube-dns"
LABELS = {"k8s-app": "kube-dns"}


def binary_path() -> Path:
    cache = Path(os.environ.get("CB_CACHE", str(Path.home() / ".cache" / "containerboot-py")))
    return cache / "bin" / f"coredns-{COREDNS_VER}" / "coredns"


def ensure_binary(timeout: float = 30 * 60) -> Path:
    """The coredns binary, built by scripts/install-coredns.sh if missing (under an flock, so two test sessions
    do not build twice)."""
    b = binary_path()
    if os.access(b, os.X_OK):
        return b
    if shutil.which("go") is None:
        raise RuntimeError(f"CoreDNS missing at {b} and no Go toolchain to build it")
    import fcntl
    lock_path = b.parent.parent.parent / ".build-coredns.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.access(b, os.X_OK):
            return b
        cp = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "COREDNS_VER": COREDNS_VER})
        if cp.returncode != 0 or not os.access(b, os.X_OK):
            raise RuntimeError(f"install-coredns.sh failed (exit {cp.returncode}):\n{cp.stderr[-4000:]}")
    return b


def cluster_dns_ip(service_cidr: str) -> str:
    """kubeadm's choice: the tenth address of the (first) Service range."""
    net = ipaddress.ip_network(service_cidr.split(",")[0].strip())
    return str(net.network_address + 10)


def corefile(cluster_domain: str = "cluster.local") -> str:
    return f"""\
.:53 {{
    errors
    health {{
       lameduck 2s
    }}
    ready
    kubernetes {cluster_domain} in-addr.arpa ip6.arpa {{
       pods insecure
       fallthrough in-addr.arpa ip6.arpa
       ttl 30
    }}
    cache 30
    reload 2s
    loadbalance
}}
"""


def image_archive(binary: Path) -> bytes:
    return ociimage.oci_archive(IMAGE, [ociimage.File("coredns", binary.read_bytes())], ["/coredns"])


def image_archive_path() -> Path:
    """The image's archive, next to the binary: made once (a second of hashing 50 MB), then reused by every
    cluster (the archive is a pure function of the binary)."""
    binary = binary_path()
    p = binary.with_name("coredns-image.oci.tar")
    if not p.exists() or p.stat().st_mtime < binary.stat().st_mtime:
        tmp = p.with_name(f".{p.name}.{os.getpid()}")
        tmp.write_bytes(image_archive(binary))
        os.replace(tmp, p)
    return p


def manifests(dns_ip: str, cluster_domain: str = "cluster.local", *, replicas: int = 1,
              node: str = "") -> list[dict]:
    """`node`: the node CoreDNS runs on (the first node, with the control plane): a test that takes another node
    away keeps its cluster DNS (kubeadm instead runs two replicas spread over the nodes)."""
    meta = {"namespace": NAMESPACE, "labels": dict(LABELS)}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "coredns", "namespace": NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "system:coredns"},
         "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "system:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
         "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": NAMESPACE}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CONFIGMAP, "namespace": NAMESPACE},
         "data": {"Corefile": corefile(cluster_domain)}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "coredns", **meta},
         "spec": {"replicas": replicas, "selector": {"matchLabels": dict(LABELS)},
                  "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
                  "template": {"metadata": {"labels": dict(LABELS)}, "spec": {
                      "priorityClassName": "system-cluster-critical", "serviceAccountName": "coredns",
                      "dnsPolicy": "Default", "terminationGracePeriodSeconds": 5,
                      **({"nodeSelector": {"kubernetes.io/hostname": node}} if node else {}),
                      "containers": [{
                          "name": "coredns", "image": IMAGE, "imagePullPolicy": "Never",
                          "args": ["-conf", "/etc/coredns/Corefile"],
                          "volumeMounts": [{"name": "config-volume", "mountPath": "/etc/coredns", "readOnly": True}],
                          "ports": [{"name": "dns", "containerPort": 53, "protocol": "UDP"},
                                    {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"}],
                          "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181}, "periodSeconds": 1},
                          "livenessProbe": {"httpGet": {"path": "/health", "port": 8080},
                                            "initialDelaySeconds": 10, "periodSeconds": 10},
                          "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                              "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]}}}],
                      "volumes": [{"name": "config-volume", "configMap": {
                          "name": CONFIGMAP, "items": [{"key": "Corefile", "path": "Corefile"}]}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": SERVICE, **meta},
         "spec": {"selector": dict(LABELS), "clusterIP": dns_ip,
                  "ports": [{"name": "dns", "port": 53, "protocol": "UDP"},
                            {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]}},
    ]
