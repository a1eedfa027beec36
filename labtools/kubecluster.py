"""A real Kubernetes (v1.34.4, built here) for the lab: control plane, and optionally one or two nodes with Pods.

API (root only; binaries from scripts/install-kubernetes.sh, built on first use under an flock)::

    from labtools.kubecluster import KubeCluster
    # control plane only, on 127.0.0.1 of the calling namespace, free ports (no lab needed):
    with KubeCluster.start() as kc: ...
    # in a lab: namespace <prefix>-k8s on the island (10.99.0.50), API https://10.99.0.50:6443,
    # with node=True also containerd + kubelet + kube-proxy + CNI there (Pods get 10.244.0.0/24):
    kc = KubeCluster.start(lab=lab, node=True)      # node=False: the control plane alone, in that namespace
    # nodes=2: also node knode2 in namespace <prefix>-k8s2 (10.99.0.51, Pods 10.244.1.0/24), routes between the
    # nodes' Pod ranges, the scheduler spreading a workload's Pods over the nodes, node loss noticed in ~25 s:
    kc = KubeCluster.start(lab=lab, node=True, nodes=2); kc.nodes  # ["knode", "knode2"]
    kc.lose_node("knode2")                           # its island link down, its kubelet stopped (Pods live on)
    # (one cluster per lab at a time: the namespace is "k8s"; clusters without a lab can run side by side)
    kc.server, kc.token, kc.ca_cert, kc.kubeconfig   # admin (system:masters) by bearer token
    kc.kubectl("get", "pods", "-A")                  # runs in the cluster's network namespace
    kc.request("GET", "/api/v1/namespaces/default/secrets/x")  # -> (HTTP status, parsed JSON body)
    kc.apply(manifest_dict_or_list); kc.wait_node_ready(); kc.import_image(path_to_oci_archive)
    kc.service_account_token(ns, sa); kc.write_kubeconfig(path, token)   # a client with a ServiceAccount's RBAC
    kc.popen(argv)                                   # a background process in the cluster's network namespace
    kc.audit(user=..., name=...)                     # the API server's audit events on Secrets (with status)
    KubeCluster.start(service_cidr="10.96.0.0/16,fd00:10:96::/108",   # dual-stack Services
                      audit_users=(user,),           # audit() then has every request of that user
                      controllers=("garbagecollector", "serviceaccount"))   # only these controllers
    kc.serving_cert("hook", ("IP:10.99.0.50",))      # (crt, key) signed by the cluster CA, e.g. for a webhook
    kc.restart_apiserver(); kc.stop_component("kube-apiserver")
    kc.close()                                       # nothing left (processes, mounts, cgroups, netns, files)
    # a test process killed with a cluster running: `make clean-lab` (kubecluster.reap_stale) removes it
    kc.timings                                       # seconds: pki, etcd, apiserver, control_plane, node_ready...

What runs, and why so:
* etcd (``--unsafe-no-fsync``: a test cluster's data is thrown away) and kube-apiserver with TLS from the lab's
  own CA (openssl), RBAC + Node authorization, NodeRestriction, an admin bearer token (token file), and the
  service-account issuer ``https://kubernetes.default.svc`` with an EC key; kube-controller-manager (service
  account credentials, node CIDR allocation) and kube-scheduler, each with its own client certificate, no
  serving port (``--secure-port=0``) and no leader election, so several clusters can run side by side.
* The node (``node=True``, lab only): every node process runs in the cluster's network namespace AND one
  private mount namespace (a "holder" process made with ``unshare --mount``), with tmpfs on /run and
  /var/lib and the run directory's ``varlog`` on /var/log: the kubelet's volume mounts are seen by
  containerd (same mount namespace), the Pods' network namespaces (pinned under /run/netns), the shims'
  sockets and /var/log/containers never appear on the host, and they all vanish with the holder.
  containerd (Debian's 1.6) has its own config, root, state and socket in the run directory, cgroupfs, and
  ``restrict_oom_score_adj = true`` (root here lacks CAP_SYS_RESOURCE: without it every sandbox fails with
  ``can't get final child's PID from pipe: EOF``). The sandbox image is ``localhost/pause:lab``, an OCI
  archive of the static ``pause`` program made by labtools.ociimage and imported with ``ctr``. The kubelet
  puts Pods under the cgroup ``/cbpy-<name>`` (created here, removed at close), so clusters do not share
  cgroups. CNI: bridge ``cni0`` + host-local IPAM + portmap, with ipMasq so Pods reach the island.
  kube-proxy in ``iptables`` or ``nftables`` mode; its and the CNI's chains live in the cluster's namespace.
* A second node (``nodes=2``) is the first one again in its own network namespace, mount namespace (holder),
  run directory, cgroup root and certificates; each node routes the other's Pod range to the other's island
  address (no overlay; the CNI's ipMasq SNATs Pod traffic leaving the node). Its start adds about 3 s.
* Nothing is reachable from the host's own network and nothing is added to the host's firewall.
"""
from __future__ import annotations

import atexit
import ipaddress
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from labtools import coredns, ociimage
from labtools.lab import stop_process

REPO_ROOT = Path(__file__).resolve().parent.parent
INSTALL_SCRIPT = REPO_ROOT / "scripts" / "install-kubernetes.sh"
K8S_VER = os.environ.get("K8S_VER", "v1.34.4")
ETCD_VER = os.environ.get("ETCD_VER", "v3.6.4")
K8S_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy", "kubectl",
                "etcd", "pause", "lab-echo")
SYS_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
CNI_BIN_DIR = "/usr/lib/cni"
PAUSE_IMAGE = "localhost/pause:lab"
ECHO_IMAGE = "localhost/lab-echo:lab"
NODE_HOST = 50          # the cluster's namespace on the island: 10.99.0.50
NODE_NAME = "knode"
#: Node-loss timing: a node whose kubelet has not renewed its Lease for kube-controller-manager's
#: `--node-monitor-grace-period` is marked Unknown and tainted unreachable (its Pods not Ready); its Pods (which
#: tolerate that taint for the API server's `--default-unreachable-toleration-seconds`) are then deleted (they
#: stay Terminating, as no kubelet confirms). A cluster runs with Kubernetes' defaults (KUBERNETES_NODE_LOSS)
#: unless started with other values; SHORT_NODE_LOSS ends a test of a lost node in about half a minute.
KUBERNETES_NODE_LOSS = (50, 300)
SHORT_NODE_LOSS = (20, 5)

_LIVE: "weakref.WeakSet[KubeCluster]" = weakref.WeakSet()


class ClusterError(RuntimeError):
    """A component did not start or a command failed; the message says which, with its log's tail."""


# --------------------------------------------------------------------------------------------------------
# binaries
# --------------------------------------------------------------------------------------------------------

def default_bin_dir() -> Path:
    cache = Path(os.environ.get("CB_CACHE", str(Path.home() / ".cache" / "containerboot-py")))
    return cache / "bin" / f"k8s-{K8S_VER}-etcd-{ETCD_VER}"


def binaries_present(bin_dir: Path) -> bool:
    return all(os.access(bin_dir / b, os.X_OK) for b in K8S_BINARIES)


def ensure_binaries(timeout: float = 60 * 60) -> Path:
    """The directory with the Kubernetes binaries, built by scripts/install-kubernetes.sh if missing (under an
    flock, so two test sessions do not build twice). ``CBPY_K8S_BIN_DIR`` overrides it (no build then)."""
    override = os.environ.get("CBPY_K8S_BIN_DIR")
    if override:
        if not binaries_present(Path(override)):
            raise ClusterError(f"CBPY_K8S_BIN_DIR={override} lacks one of {K8S_BINARIES}")
        return Path(override)
    bdir = default_bin_dir()
    if binaries_present(bdir):
        return bdir
    if shutil.which("go") is None:
        raise ClusterError(f"Kubernetes binaries missing in {bdir} and no Go toolchain to build them")
    import fcntl
    lock_path = bdir.parent.parent / ".build-k8s.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binaries_present(bdir):
            return bdir
        cp = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "K8S_VER": K8S_VER, "ETCD_VER": ETCD_VER})
        if cp.returncode != 0 or not binaries_present(bdir):
            raise ClusterError(f"install-kubernetes.sh failed (exit {cp.returncode}):\n{cp.stderr[-4000:]}")
        return bdir


# --------------------------------------------------------------------------------------------------------
# the functional core: configuration in, argv / files out
# --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ClusterConfig:
    """Everything that decides the cluster's files and command lines."""
    name: str                    # unique per cluster (cgroup root, log names)
    run_dir: Path
    bin_dir: Path
    api_host: str                # the API server's (and the node's) address
    api_port: int = 6443
    etcd_port: int = 2379
    etcd_peer_port: int = 2380
    service_cidr: str = "10.96.0.0/16"     # one range, or "v4,v6" for dual-stack Services
    cluster_cidr: str = "10.244.0.0/16"
    node_cidr_mask: int = 24
    node_name: str = NODE_NAME
    proxy_mode: str = "iptables"
    token: str = ""
    audit_users: tuple[str, ...] = ()     # also audit every request of these users (not only Secrets)
    controllers: tuple[str, ...] = ()     # kube-controller-manager's --controllers; () = its default set
    cluster_dns: str = ""                 # the kubelet's clusterDNS (CoreDNS's Service), "" = no cluster DNS
    # a node's own settings: the first node shares the control plane's namespace and address (node_dir
    # "node"); another node has its own directory, address and cgroup root (see node_config)
    node_dir: str = "node"
    node_ip: str = ""
    extra_nodes: tuple[tuple[str, str], ...] = ()   # (name, address) of the nodes after the first
    spread_pods: bool = False             # the scheduler spreads a workload's Pods over the nodes (hard)
    #: (--node-monitor-grace-period, --default-unreachable-toleration-seconds) in seconds; None: not passed,
    #: Kubernetes' defaults (KUBERNETES_NODE_LOSS)
    node_loss: tuple[int, int] | None = None

    @property
    def server(self) -> str:
        host = f"[{self.api_host}]" if ":" in self.api_host else self.api_host
        return f"https://{host}:{self.api_port}"

    @property
    def kubernetes_service_ip(self) -> str:
        # the first range's first address (a dual-stack cluster's primary family)
        return str(next(ipaddress.ip_network(self.service_cidr.split(",")[0]).hosts()))

    @property
    def pki(self) -> Path:
        return self.run_dir / "pki"

    @property
    def first_node(self) -> bool:
        return self.node_dir == "node"

    @property
    def node_suffix(self) -> str:
        """Appended to a node's certificate, kubeconfig and cgroup names ("" for the first node)."""
        return "" if self.first_node else f"-{self.node_name}"

    @property
    def kubelet_ip(self) -> str:
        return self.node_ip or self.api_host

    @property
    def node_run_dir(self) -> Path:
        return self.run_dir / self.node_dir

    @property
    def cgroup_root(self) -> str:
        return f"/cbpy-{self.name}{self.node_suffix}"

    @property
    def containerd_dir(self) -> Path:
        return self.run_dir / "containerd" if self.first_node else self.node_run_dir / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.containerd_dir / "containerd.sock"

    def kubeconfig_path(self, who: str) -> Path:
        return self.run_dir / "kubeconfig" / f"{who}.json"


@dataclass(frozen=True)
class CertSpec:
    name: str
    cn: str
    org: str = ""
    server: bool = False
    client: bool = False
    sans: tuple[str, ...] = ()


def node_config(cfg: ClusterConfig, name: str, ip: str) -> ClusterConfig:
    """The configuration of a node after the first: its own name, address, directory and cgroup root."""
    from dataclasses import replace
    return replace(cfg, node_name=name, node_ip=ip, node_dir=f"node-{name}")


def cert_plan(cfg: ClusterConfig) -> list[CertSpec]:
    """The certificates of the cluster, each for one identity the default RBAC roles already know."""
    api_sans = tuple(dict.fromkeys((
        f"IP:{cfg.api_host}", "IP:127.0.0.1", f"IP:{cfg.kubernetes_service_ip}", "DNS:localhost", "DNS:kubernetes",
        "DNS:kubernetes.default", "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local")))
    return [
        CertSpec("apiserver", "kube-apiserver", server=True, sans=api_sans),
        CertSpec("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters", client=True),
        CertSpec("controller-manager", "system:kube-controller-manager", client=True),
        CertSpec("scheduler", "system:kube-scheduler", client=True),
        CertSpec("kubelet-client", f"system:node:{cfg.node_name}", "system:nodes", client=True),
        CertSpec("kubelet-serving", cfg.node_name, server=True, sans=(f"IP:{cfg.api_host}", f"DNS:{cfg.node_name}")),
        CertSpec("kube-proxy", "system:kube-proxy", client=True),
        *[spec for name, ip in cfg.extra_nodes for spec in (
            CertSpec(f"kubelet-client-{name}", f"system:node:{name}", "system:nodes", client=True),
            CertSpec(f"kubelet-serving-{name}", name, server=True, sans=(f"IP:{ip}", f"DNS:{name}")))],
    ]


def openssl_ext(spec: CertSpec) -> str:
    """An openssl config for one leaf certificate (no CA bit, the right key usages, the SANs)."""
    eku = ",".join(u for u, on in (("serverAuth", spec.server), ("clientAuth", spec.client)) if on)
    lines = ["[req]", "distinguished_name = dn", "x509_extensions = ext", "prompt = no", "[dn]", "CN = unused",
             "[ext]", "basicConstraints = critical,CA:FALSE", "keyUsage = critical,digitalSignature,keyEncipherment",
             f"extendedKeyUsage = {eku}", "subjectKeyIdentifier = hash", "authorityKeyIdentifier = keyid"]
    if spec.sans:
        lines.append("subjectAltName = " + ",".join(spec.sans))
    return "\n".join(lines) + "\n"


def kubeconfig(server: str, ca: Path, user: str, *, token: str = "", cert: Path | None = None,
               key: Path | None = None) -> dict:
    creds: dict[str, str] = {"token": token} if token else {"client-certificate": str(cert), "client-key": str(key)}
    return {"apiVersion": "v1", "kind": "Config", "current-context": "lab",
            "clusters": [{"name": "lab", "cluster": {"server": server, "certificate-authority": str(ca)}}],
            "users": [{"name": user, "user": creds}],
            "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": user}}]}


def etcd_argv(cfg: ClusterConfig) -> list[str]:
    client = f"http://127.0.0.1:{cfg.etcd_port}"
    peer = f"http://127.0.0.1:{cfg.etcd_peer_port}"
    return [str(cfg.bin_dir / "etcd"), "--name=lab", f"--data-dir={cfg.run_dir / 'etcd'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=lab={peer}", "--unsafe-no-fsync", "--log-level=warn"]


def apiserver_argv(cfg: ClusterConfig) -> list[str]:
    p = cfg.pki
    return [str(cfg.bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{cfg.etcd_port}",
            f"--bind-address={cfg.api_host}", f"--advertise-address={cfg.api_host}", f"--secure-port={cfg.api_port}",
            f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}", f"--token-auth-file={p / 'tokens.csv'}",
            f"--service-account-key-file={p / 'sa.key'}", f"--service-account-signing-key-file={p / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            f"--service-cluster-ip-range={cfg.service_cidr}", "--allow-privileged=true",
            f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
            "--kubelet-preferred-address-types=InternalIP", "--profiling=false", "--v=1",
            # every request on Secrets, with its response code, for the tests (KubeCluster.audit)
            f"--audit-policy-file={p / 'audit-policy.json'}",
            f"--audit-log-path={cfg.run_dir / 'logs' / 'audit.jsonl'}",
            "--audit-log-mode=blocking",
            *([f"--default-unreachable-toleration-seconds={cfg.node_loss[1]}",
               f"--default-not-ready-toleration-seconds={cfg.node_loss[1]}"] if cfg.node_loss else [])]


AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
                "rules": [{"level": "Metadata", "resources": [{"group": "", "resources": ["secrets"]}]},
                          {"level": "None"}]}


def audit_policy(cfg: ClusterConfig) -> dict:
    """AUDIT_POLICY, and first every completed request of ``cfg.audit_users`` (one event per request, so a
    benchmark can count them: watches' ResponseStarted left out)."""
    if not cfg.audit_users:
        return AUDIT_POLICY
    rule = {"level": "Metadata", "users": list(cfg.audit_users), "omitStages": ["RequestReceived", "ResponseStarted"]}
    return {**AUDIT_POLICY, "rules": [rule, *AUDIT_POLICY["rules"]]}


def controller_manager_argv(cfg: ClusterConfig) -> list[str]:
    p = cfg.pki
    return [str(cfg.bin_dir / "kube-controller-manager"), f"--kubeconfig={cfg.kubeconfig_path('controller-manager')}",
            "--secure-port=0", "--leader-elect=false", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={p / 'sa.key'}", f"--root-ca-file={p / 'ca.crt'}",
            f"--cluster-signing-cert-file={p / 'ca.crt'}", f"--cluster-signing-key-file={p / 'ca.key'}",
            "--allocate-node-cidrs=true", f"--cluster-cidr={cfg.cluster_cidr}",
            f"--node-cidr-mask-size={cfg.node_cidr_mask}", f"--service-cluster-ip-range={cfg.service_cidr}",
            "--profiling=false", "--v=1", *([f"--controllers={','.join(cfg.controllers)}"] if cfg.controllers else []),
            *([f"--node-monitor-grace-period={cfg.node_loss[0]}s"] if cfg.node_loss else [])]


def scheduler_argv(cfg: ClusterConfig) -> list[str]:
    if cfg.spread_pods:
        return [str(cfg.bin_dir / "kube-scheduler"), f"--config={cfg.run_dir / 'scheduler.json'}",
                "--secure-port=0", "--v=1"]
    return [str(cfg.bin_dir / "kube-scheduler"), f"--kubeconfig={cfg.kubeconfig_path('scheduler')}",
            "--secure-port=0", "--leader-elect=false", "--profiling=false", "--v=1"]


def scheduler_config(cfg: ClusterConfig) -> dict:
    """With ``spread_pods``: the cluster-wide default topology spread made a hard rule on the node's hostname,
    so the Pods of one StatefulSet or ReplicaSet land on different nodes as a preferred anti-affinity would put
    them on an idle cluster, without the workload having to ask (the ProxyGroup, as upstream's, sets none)."""
    spread = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule"}
    return {"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(cfg.kubeconfig_path("scheduler"))},
            "leaderElection": {"leaderElect": False}, "enableProfiling": False,
            "profiles": [{"schedulerName": "default-scheduler", "pluginConfig": [
                {"name": "PodTopologySpread",
                 "args": {"defaultingType": "List", "defaultConstraints": [spread]}}]}]}


def kubelet_config(cfg: ClusterConfig) -> dict:
    p = cfg.pki
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": cfg.kubelet_ip, "port": 10250, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
        "tlsCertFile": str(p / f"kubelet-serving{cfg.node_suffix}.crt"),
        "tlsPrivateKeyFile": str(p / f"kubelet-serving{cfg.node_suffix}.key"),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(p / "ca.crt")}},
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs", "cgroupRoot": cfg.cgroup_root, "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"], "failCgroupV1": False, "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{cfg.containerd_socket}",
        "clusterDomain": "cluster.local", "resolvConf": str(cfg.node_run_dir / "resolv.conf"),
        **({"clusterDNS": [cfg.cluster_dns]} if cfg.cluster_dns else {}),
        # a test node on a shared machine: never evict, and never collect imported images (no registry
        # could bring them back)
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "nodefs.inodesFree": "1%",
                         "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "makeIPTablesUtilChains": False, "serializeImagePulls": False,
        "syncFrequency": "10s", "fileCheckFrequency": "10s", "nodeStatusReportFrequency": "10s",
        "podLogsDir": "/var/log/pods", "shutdownGracePeriod": "0s",
    }


def kubelet_argv(cfg: ClusterConfig) -> list[str]:
    node = cfg.node_run_dir
    return [str(cfg.bin_dir / "kubelet"), f"--config={node / 'kubelet.json'}",
            f"--kubeconfig={cfg.kubeconfig_path('kubelet' + cfg.node_suffix)}", f"--hostname-override={cfg.node_name}",
            f"--node-ip={cfg.kubelet_ip}", f"--root-dir={node / 'kubelet'}", f"--cert-dir={node / 'kubelet-pki'}",
            "--v=1"]


def kube_proxy_config(cfg: ClusterConfig) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(cfg.kubeconfig_path("kube-proxy"))},
        "mode": cfg.proxy_mode, "clusterCIDR": cfg.cluster_cidr, "hostnameOverride": cfg.node_name,
        "healthzBindAddress": "127.0.0.1:10256", "metricsBindAddress": "127.0.0.1:10249",
        # the namespace's conntrack sysctls are not kube-proxy's to change on a shared machine
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def kube_proxy_argv(cfg: ClusterConfig) -> list[str]:
    return [str(cfg.bin_dir / "kube-proxy"), f"--config={cfg.node_run_dir / 'kube-proxy.json'}", "--v=1"]


def containerd_config(cfg: ClusterConfig) -> str:
    c = cfg.containerd_dir
    unused = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
              "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
              "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
    return f"""\
version = 2
root = "{c / 'root'}"
state = "{c / 'state'}"
disabled_plugins = {json.dumps(unused)}

[grpc]
  address = "{cfg.containerd_socket}"

[ttrpc]
  address = "{c / 'containerd.sock.ttrpc'}"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{c / 'opt'}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{c / 'runc'}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cfg.node_run_dir / 'cni'}"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{c / 'certs.d'}"
"""


def cni_conflist(cfg: ClusterConfig, pod_cidr: str) -> dict:
    gw = str(next(ipaddress.ip_network(pod_cidr).hosts()))
    return {
        "cniVersion": "1.0.0", "name": "lab",
        "plugins": [
            {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": pod_cidr, "gateway": gw}]],
                      "routes": [{"dst": "0.0.0.0/0"}],
                      "dataDir": str(cfg.node_run_dir / "ipam")}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def holder_script(cfg: ClusterConfig) -> str:
    """The node's private mount namespace: /run and /var/lib private tmpfs, /var/log from the run dir."""
    varlog = cfg.node_run_dir / "varlog"
    ready = cfg.node_run_dir / "holder.ready"
    return (f"set -e; mount -t tmpfs -o mode=755 tmpfs /run; mount -t tmpfs -o mode=755 tmpfs /var/lib; "
            f"mkdir -p /run/netns; mount --bind {shlex.quote(str(varlog))} /var/log; "
            f"echo ok > {shlex.quote(str(ready))}; exec sleep infinity")


# --------------------------------------------------------------------------------------------------------
# the imperative shell
# --------------------------------------------------------------------------------------------------------

def _run(argv: Sequence[str], *, timeout: float = 60.0, check: bool = True, input: str | bytes | None = None,
         env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    text = not isinstance(input, bytes)
    try:
        cp = subprocess.run(list(argv), capture_output=True, text=text, timeout=timeout, input=input,
                            env=dict(env) if env else None, stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"timed out after {timeout}s: {shlex.join(argv)}") from e
    if check and cp.returncode != 0:
        raise ClusterError(f"command failed (exit {cp.returncode}): {shlex.join(argv)[:300]}\n"
                           f"{cp.stdout if text else ''}{cp.stderr if text else cp.stderr.decode(errors='replace')}")
    return cp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, timeout: float, what: str, interval: float = 0.2, procs: Sequence["_Proc"] = ()) -> Any:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        for pr in procs:
            if pr.proc.poll() is not None:
                raise ClusterError(f"{pr.name} exited ({pr.proc.returncode}) while waiting for {what}; log tail:\n"
                                   f"{pr.tail()}")
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # "not yet" looks like anything
            last = e
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}"
                               + (f" (last: {last!r})" if last else ""))
        time.sleep(interval)


@dataclass
class _Proc:
    name: str
    argv: list[str]
    proc: subprocess.Popen
    log: Path
    logf: Any = field(repr=False)

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class KubeCluster:
    """See the module docstring. ``KubeCluster.start(...)``; a context manager; ``close()`` is idempotent."""

    def __init__(self, cfg: ClusterConfig, *, lab: Any = None, netns: str | None = None) -> None:
        self.cfg = cfg
        self.lab = lab
        self.netns = netns                  # full netns name, None = the caller's namespace
        self.procs: dict[str, _Proc] = {}
        self.holder: _Proc | None = None
        self.timings: dict[str, float] = {}
        self._closed = False
        self._lock = threading.Lock()
        self._made_cgroups: list[Path] = []
        self.with_node = False
        self._made_run_dir = False
        self.holders: dict[str, _Proc] = {}
        self.node_cfgs: dict[str, ClusterConfig] = {}
        self.pod_cidrs: dict[str, str] = {}
        self._node_links: dict[str, str] = {}     # node -> its veth's name on the island bridge
        self._node_netns: dict[str, str] = {}
        self._lost: set[str] = set()

    # ------------------------------------------------------------------ properties for clients
    @property
    def server(self) -> str:
        return self.cfg.server

    @property
    def token(self) -> str:
        return self.cfg.token

    @property
    def ca_cert(self) -> Path:
        return self.cfg.pki / "ca.crt"

    @property
    def kubeconfig(self) -> Path:
        return self.cfg.kubeconfig_path("admin")

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, *, lab: Any = None, node: bool = False, proxy_mode: str = "iptables",
              run_dir: str | Path | None = None, bin_dir: str | Path | None = None, name: str | None = None,
              timeout: float = 90.0, service_cidr: str = ClusterConfig.service_cidr,
              audit_users: Sequence[str] = (), controllers: Sequence[str] = (), nodes: int = 1,
              dns: bool = True, node_loss: tuple[int, int] | None = None) -> "KubeCluster":
        """Start a control plane (and with ``node=True``, which needs ``lab``, a node) and wait until it is
        ready (with a node: Node Ready and the ``default`` ServiceAccount present). ``service_cidr``
        "v4,v6" makes Services dual-stack; ``audit_users``: ``audit(user=...)`` then has every request of
        those users, not only those on Secrets; ``controllers``: only these of kube-controller-manager (e.g.
        a test that writes a StatefulSet's status itself runs without the statefulset controller); ``nodes=2``
        (with ``node=True``): a second node ``knode2`` in its own namespace ``k8s2`` (10.99.0.51), routes between
        the nodes' Pod ranges, and the scheduler spreading a workload's Pods over the nodes; ``dns``: with a node,
        CoreDNS as the cluster DNS (``labtools.coredns``; started, not waited for: ``wait_dns``); ``node_loss``: the
        node-monitor grace period and the unreachable toleration in seconds (e.g. SHORT_NODE_LOSS), None for
        Kubernetes' defaults (KUBERNETES_NODE_LOSS). On failure
        everything started is torn down and ClusterError says which component failed, with its log."""
        if os.geteuid() != 0:
            raise ClusterError("the cluster needs root")
        if node and lab is None:
            raise ClusterError("node=True needs a lab (the node lives in a namespace of the island)")
        if nodes < 1 or (nodes > 1 and not node):
            raise ClusterError(f"nodes={nodes}: use 1, or more with node=True")
        if proxy_mode not in ("iptables", "nftables"):
            raise ClusterError(f"proxy_mode={proxy_mode!r}: use iptables or nftables")
        bdir = Path(bin_dir) if bin_dir else ensure_binaries()
        dns_ip = coredns.cluster_dns_ip(service_cidr) if node and dns else ""
        if dns_ip:
            coredns.ensure_binary()
        import secrets as _secrets
        name = name or (f"{lab.prefix}k" if lab is not None else "k" + _secrets.token_hex(3))
        if lab is not None:
            rdir = Path(run_dir) if run_dir else lab.run_dir / "k8s"
            net = lab.namespaces["hs"].ipv4.rsplit(".", 1)[0]
            host = f"{net}.{NODE_HOST}"
            extra = tuple((f"{NODE_NAME}{i + 1}", f"{net}.{NODE_HOST + i}") for i in range(1, nodes))
            cfg = ClusterConfig(name, rdir, bdir, host, proxy_mode=proxy_mode, token=_secrets.token_hex(16),
                                service_cidr=service_cidr, audit_users=tuple(audit_users),
                                controllers=tuple(controllers), extra_nodes=extra, spread_pods=nodes > 1,
                                cluster_dns=dns_ip, node_loss=node_loss)
        else:
            rdir = Path(run_dir) if run_dir else Path("/tmp") / f"cbpy-{name}"
            cfg = ClusterConfig(name, rdir, bdir, "127.0.0.1", api_port=_free_port(), etcd_port=_free_port(),
                                etcd_peer_port=_free_port(), proxy_mode=proxy_mode, token=_secrets.token_hex(16),
                                service_cidr=service_cidr, audit_users=tuple(audit_users),
                                controllers=tuple(controllers), cluster_dns=dns_ip, node_loss=node_loss)
        kc = cls(cfg, lab=lab)
        _LIVE.add(kc)
        try:
            t0 = time.monotonic()
            rdir.mkdir(parents=True, exist_ok=False)    # another live cluster's directory is never reused
            kc._made_run_dir = True
            (rdir / "owner").write_text(f"{os.getpid()}\n")
            (rdir / "name").write_text(f"{name}\n")
            if lab is not None:
                kc.netns = kc._add_node_namespace("k8s", NODE_HOST)
                kc._node_netns[cfg.node_name] = kc.netns
            kc._write_pki()
            kc.timings["pki"] = time.monotonic() - t0
            kc._start_control_plane()
            kc.timings["control_plane"] = time.monotonic() - t0
            if node:
                assert kc.netns is not None
                kc._start_node(cfg, kc.netns)
                kc._node_links[cfg.node_name] = "v-k8s"
                kc.timings["node_ready"] = time.monotonic() - t0
                for i, (nname, nip) in enumerate(cfg.extra_nodes, start=1):
                    ns_name = f"k8s{i + 1}"
                    netns = kc._add_node_namespace(ns_name, NODE_HOST + i)
                    kc._node_netns[nname] = netns
                    kc._node_links[nname] = f"v-{ns_name}"[:15]
                    kc._start_node(node_config(cfg, nname, nip), netns)
                kc._route_pod_ranges()
                kc.timings["nodes_ready"] = time.monotonic() - t0
            kc._wait_default_sa(timeout)
            kc.timings["start_total"] = time.monotonic() - t0
        except BaseException:
            kc.close()
            raise
        return kc

    def _add_node_namespace(self, ns_name: str, host: int) -> str:
        info = self.lab.add_namespace(ns_name, host=host)
        self.lab._sysctl(info.netns, "net.ipv4.ip_forward", "1")
        # a previous cluster of this lab had the same addresses on another MAC: a neighbour entry
        # still REACHABLE elsewhere would black-hole new connections to the node for up to 45 s
        for other in list(self.lab.namespaces.values()):
            if other.netns != info.netns:
                for addr in (info.ipv4, info.ipv6):
                    if addr:
                        _run(["ip", "-n", other.netns, "neigh", "flush", "to", addr], check=False)
        return info.netns

    def _route_pod_ranges(self) -> None:
        """Each node reaches the other nodes' Pod ranges through their island addresses (no overlay)."""
        for node, netns in self._node_netns.items():
            for other, cidr in self.pod_cidrs.items():
                if other != node:
                    _run(["ip", "-n", netns, "route", "replace", cidr, "via", self.node_ip(other)])

    def __enter__(self) -> "KubeCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ processes
    def _wrap(self, argv: Sequence[str], env: Mapping[str, str], *, in_node: bool,
              holder: _Proc | None = None) -> list[str]:
        envargs = ["env", "-i", *[f"{k}={v}" for k, v in env.items()]]
        holder = holder or (self.holder if in_node else None)
        if holder is not None:
            return ["nsenter", f"--target={holder.proc.pid}", "--mount", "--net", "--", *envargs, *argv]
        if self.netns:
            return ["nsenter", f"--net=/run/netns/{self.netns}", "--", *envargs, *argv]
        return [*envargs, *argv]

    def _env(self) -> dict[str, str]:
        return {"PATH": f"{self.cfg.bin_dir}:{SYS_PATH}", "HOME": str(self.cfg.run_dir)}

    def _spawn(self, name: str, argv: Sequence[str], *, in_node: bool = False, raw: bool = False,
               holder: _Proc | None = None) -> _Proc:
        log = self.cfg.run_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        logf = open(log, "ab", buffering=0)
        full = list(argv) if raw else self._wrap(argv, self._env(), in_node=in_node, holder=holder)
        p = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                             start_new_session=True, cwd=str(self.cfg.run_dir))
        pr = _Proc(name, list(argv), p, log, logf)
        self.procs[name] = pr
        return pr

    def run(self, argv: Sequence[str], *, timeout: float = 60.0, check: bool = True,
            input: str | bytes | None = None, in_node: bool = False) -> subprocess.CompletedProcess:
        """Run a command in the cluster's network namespace (``in_node``: also in the node's mount namespace)."""
        return _run(self._wrap(argv, self._env(), in_node=in_node), timeout=timeout, check=check, input=input)

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start a background command in the cluster's network namespace (the caller stops it)."""
        return subprocess.Popen(self._wrap(argv, {**self._env(), **kw.pop("env", {})}, in_node=False), **kw)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60.0) -> subprocess.CompletedProcess:
        """kubectl as the admin, in the cluster's network namespace."""
        return self.run([str(self.cfg.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                        input=input, check=check, timeout=timeout)

    def request(self, method: str, path: str, body: Any = None, *, token: str | None = None,
                content_type: str = "application/json", timeout: float = 20.0) -> tuple[int, Any]:
        """One API request with curl (admin token unless ``token``): (HTTP status, parsed JSON or text)."""
        argv = ["curl", "-sS", "--noproxy", "*", "-m", str(timeout), "--cacert", str(self.ca_cert),
                "-H", f"Authorization: Bearer {token or self.token}", "-X", method, "-o", "-", "-w", "\n%{http_code}"]
        data = None
        if body is not None:
            data = body if isinstance(body, str) else json.dumps(body)
            argv += ["-H", f"Content-Type: {content_type}", "--data-binary", "@-"]
        argv.append(self.server + path)
        cp = self.run(argv, input=data, check=False, timeout=timeout + 5)
        if cp.returncode != 0:
            raise ClusterError(f"curl {method} {path} failed (exit {cp.returncode}): {cp.stderr.strip()}")
        text, _, code = cp.stdout.rpartition("\n")
        try:
            parsed: Any = json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            parsed = text
        return int(code), parsed

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A token for the ServiceAccount (TokenRequest), e.g. to run a controller with its real RBAC."""
        code, body = self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                                  {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                   "spec": {"expirationSeconds": seconds}})
        if code != 201:
            raise ClusterError(f"TokenRequest for {namespace}/{name}: HTTP {code}: {body}")
        return body["status"]["token"]

    def write_kubeconfig(self, path: str | Path, token: str, user: str = "user") -> Path:
        """A kubeconfig file for ``token`` (this cluster's server and CA), for kubectl or a client library."""
        p = Path(path)
        p.write_text(json.dumps(kubeconfig(self.server, self.ca_cert, user, token=token), indent=1))
        p.chmod(0o600)
        return p

    def apply(self, objs: Mapping | Sequence[Mapping]) -> str:
        """``kubectl apply`` of one manifest or a list (server-side apply, field manager ``lab``)."""
        items = [objs] if isinstance(objs, Mapping) else list(objs)
        doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        return self.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=lab", "-f", "-",
                            input=doc).stdout

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict | None:
        ns = ["-n", namespace] if namespace else []
        cp = self.kubectl("get", kind, name, *ns, "-o", "json", check=False)
        if cp.returncode != 0:
            if "NotFound" in cp.stderr:
                return None
            raise ClusterError(f"kubectl get {kind} {name}: {cp.stderr.strip()}")
        return json.loads(cp.stdout)

    # ------------------------------------------------------------------ PKI
    def _openssl(self, *args: str) -> None:
        _run(["openssl", *args], timeout=30)

    def _write_pki(self) -> None:
        cfg, p = self.cfg, self.cfg.pki
        p.mkdir(parents=True)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        (p / "ca.cnf").write_text("[req]\ndistinguished_name = dn\nx509_extensions = ext\nprompt = no\n[dn]\n"
                                  "CN = unused\n[ext]\nbasicConstraints = critical,CA:TRUE\n"
                                  "keyUsage = critical,keyCertSign,cRLSign\nsubjectKeyIdentifier = hash\n")
        self._openssl("req", "-x509", "-new", "-config", str(p / "ca.cnf"), *ec, "-keyout", str(p / "ca.key"),
                      "-out", str(p / "ca.crt"), "-days", "30", "-subj", f"/CN=containerboot-py lab CA {cfg.name}")
        for spec in cert_plan(cfg):
            cnf = p / f"{spec.name}.cnf"
            cnf.write_text(openssl_ext(spec))
            subj = (f"/O={spec.org}" if spec.org else "") + f"/CN={spec.cn}"
            self._openssl("req", "-x509", "-new", "-config", str(cnf), *ec, "-keyout", str(p / f"{spec.name}.key"),
                          "-out", str(p / f"{spec.name}.crt"), "-days", "30", "-subj", subj,
                          "-CA", str(p / "ca.crt"), "-CAkey", str(p / "ca.key"))
        self._openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(p / "sa.key"))
        (p / "audit-policy.json").write_text(json.dumps(audit_policy(cfg)))
        if cfg.spread_pods:
            (cfg.run_dir / "scheduler.json").write_text(json.dumps(scheduler_config(cfg), indent=1))
        (p / "tokens.csv").write_text(f'{cfg.token},lab-admin,lab-admin,"system:masters"\n')
        for f in p.iterdir():
            f.chmod(0o600)
        kdir = cfg.kubeconfig_path("x").parent
        kdir.mkdir(parents=True)
        ca = p / "ca.crt"
        files = {"admin": kubeconfig(cfg.server, ca, "lab-admin", token=cfg.token)}
        for who, cert in (("controller-manager", "controller-manager"), ("scheduler", "scheduler"),
                          ("kubelet", "kubelet-client"), ("kube-proxy", "kube-proxy"),
                          *[(f"kubelet-{n}", f"kubelet-client-{n}") for n, _ in cfg.extra_nodes]):
            files[who] = kubeconfig(cfg.server, ca, who, cert=p / f"{cert}.crt", key=p / f"{cert}.key")
        for who, kc in files.items():
            path = cfg.kubeconfig_path(who)
            path.write_text(json.dumps(kc, indent=1))
            path.chmod(0o600)

    def serving_cert(self, name: str, sans: Sequence[str]) -> tuple[Path, Path]:
        """A server certificate signed by the cluster's CA (which the API server trusts as a ``caBundle``), e.g.
        for an admission webhook the tests run: sans like ``("IP:10.99.0.50",)``. Returns (cert, key)."""
        p = self.cfg.pki
        spec = CertSpec(f"extra-{name}", name, server=True, sans=tuple(sans))
        cnf = p / f"{spec.name}.cnf"
        cnf.write_text(openssl_ext(spec))
        crt, key = p / f"{spec.name}.crt", p / f"{spec.name}.key"
        self._openssl("req", "-x509", "-new", "-config", str(cnf), "-newkey", "ec", "-pkeyopt",
                      "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out", str(crt),
                      "-days", "30", "-subj", f"/CN={name}", "-CA", str(p / "ca.crt"), "-CAkey", str(p / "ca.key"))
        key.chmod(0o600)
        return crt, key

    # ------------------------------------------------------------------ control plane
    def _readyz(self) -> bool:
        code, _ = self.request("GET", "/readyz", timeout=5)
        return code == 200

    def _start_control_plane(self, timeout: float = 60.0) -> None:
        t = time.monotonic()
        etcd = self._spawn("etcd", etcd_argv(self.cfg))
        _wait(lambda: self.run(["curl", "-sf", "-m", "2", f"http://127.0.0.1:{self.cfg.etcd_port}/health"],
                               check=False, timeout=5).returncode == 0, timeout, "etcd health", procs=[etcd])
        self.timings["etcd"] = time.monotonic() - t
        self._start_apiserver(timeout)
        self._spawn("kube-controller-manager", controller_manager_argv(self.cfg))
        self._spawn("kube-scheduler", scheduler_argv(self.cfg))

    def _start_apiserver(self, timeout: float = 60.0) -> None:
        t = time.monotonic()
        api = self._spawn("kube-apiserver", apiserver_argv(self.cfg))
        _wait(self._readyz, timeout, "kube-apiserver /readyz", 0.2, procs=[api])
        self.timings["apiserver"] = time.monotonic() - t

    def stop_component(self, name: str, timeout: float = 20.0) -> int | None:
        """SIGTERM one component (e.g. ``kube-apiserver``) and wait for it; its exit status."""
        pr = self.procs.get(name)
        if pr is None:
            return None
        stop_process(pr.proc, timeout)
        pr.logf.close()
        return pr.proc.returncode

    def restart_apiserver(self, down_for: float = 0.0, timeout: float = 60.0) -> float:
        """Stop kube-apiserver, wait ``down_for`` seconds, start it again; returns seconds until /readyz."""
        self.stop_component("kube-apiserver")
        time.sleep(down_for)
        t = time.monotonic()
        self._start_apiserver(timeout)
        return time.monotonic() - t

    def _wait_default_sa(self, timeout: float) -> None:
        _wait(lambda: self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default", timeout=5)[0] == 200,
              timeout, "the default ServiceAccount (kube-controller-manager)",
              procs=[self.procs["kube-controller-manager"]])

    # ------------------------------------------------------------------ node
    def _cgroup_mounts(self) -> list[Path]:
        out = []
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and parts[2] in ("cgroup", "cgroup2") and parts[1].startswith("/sys/fs/cgroup"):
                out.append(Path(parts[1]))
        return out

    def _make_cgroups(self, ncfg: ClusterConfig) -> None:
        for m in self._cgroup_mounts():
            d = m / ncfg.cgroup_root.lstrip("/")
            d.mkdir(exist_ok=True)
            self._made_cgroups.append(d)
            if (m / "cpuset.cpus").exists():   # v1 cpuset: a new group starts with no CPUs and no memory nodes
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (d / f).write_text((m / f).read_text())

    def _start_node(self, ncfg: ClusterConfig, netns: str, timeout: float = 60.0) -> str:
        """containerd, kubelet, kube-proxy and CNI of one node in network namespace ``netns``; its Pod CIDR."""
        node, sfx = ncfg.node_run_dir, ncfg.node_suffix
        t = time.monotonic()
        for d in ("varlog", "cni", "ipam", "kubelet", "kubelet-pki"):
            (node / d).mkdir(parents=True, exist_ok=True)
        (node / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        (node / "kubelet.json").write_text(json.dumps(kubelet_config(ncfg), indent=1))
        (node / "kube-proxy.json").write_text(json.dumps(kube_proxy_config(ncfg), indent=1))
        ncfg.containerd_dir.mkdir(parents=True, exist_ok=True)
        (ncfg.containerd_dir / "config.toml").write_text(containerd_config(ncfg))
        self._make_cgroups(ncfg)
        holder_argv = ["nsenter", f"--net=/run/netns/{netns}", "--", "unshare", "--mount",
                       "--propagation", "private", "sh", "-c", holder_script(ncfg)]
        holder = self._spawn("holder" + sfx, holder_argv, raw=True)
        self.holders[ncfg.node_name] = holder
        if ncfg.first_node:
            self.holder = holder
        _wait(lambda: (node / "holder.ready").exists(), 10, "the node's mount namespace", 0.05, procs=[holder])
        ctd = self._spawn("containerd" + sfx, ["containerd", "--config", str(ncfg.containerd_dir / "config.toml")],
                          holder=holder)
        self.node_cfgs[ncfg.node_name] = ncfg
        _wait(lambda: self._ctr("version", check=False, node=ncfg.node_name).returncode == 0, timeout,
              "containerd" + sfx, 0.1, procs=[ctd])
        self.timings["containerd" + sfx] = time.monotonic() - t
        for image, name in ((PAUSE_IMAGE, "pause"), (ECHO_IMAGE, "lab-echo")):
            files = [ociimage.File(name, (ncfg.bin_dir / name).read_bytes())]
            self.import_image_bytes(ociimage.oci_archive(image, files, [f"/{name}"]), f"{name}.tar",
                                    nodes=(ncfg.node_name,))
        if ncfg.cluster_dns:
            self._ctr("images", "import", "--no-unpack=false", str(coredns.image_archive_path()),
                      node=ncfg.node_name)
            if ncfg.first_node:
                # Before the kubelet: the Service takes its fixed address before any other Service can, and the
                # Pod is scheduled as soon as the node is Ready.
                self.apply(coredns.manifests(ncfg.cluster_dns, node=ncfg.node_name))
        self.timings["images" + sfx] = time.monotonic() - t
        t_kubelet = time.monotonic()
        kubelet = self._spawn("kubelet" + sfx, kubelet_argv(ncfg), holder=holder)
        # the CNI config needs the node's pod CIDR, which kube-controller-manager allocates once the node exists
        pod_cidr = _wait(lambda: (self.get("node", ncfg.node_name) or {}).get("spec", {}).get("podCIDR"), timeout,
                         f"node {ncfg.node_name}'s podCIDR", 0.2,
                         procs=[kubelet, self.procs["kube-controller-manager"]])
        (node / "cni" / "10-lab.conflist").write_text(json.dumps(cni_conflist(ncfg, pod_cidr), indent=1))
        self._spawn("kube-proxy" + sfx, kube_proxy_argv(ncfg), holder=holder)
        self.with_node = True
        self.pod_cidrs[ncfg.node_name] = pod_cidr
        if ncfg.first_node:
            self.pod_cidr = pod_cidr
        self.wait_node_ready(timeout, ncfg.node_name)
        self.timings["kubelet_to_ready" + sfx] = time.monotonic() - t_kubelet
        return pod_cidr

    @property
    def nodes(self) -> list[str]:
        """The names of the cluster's nodes, the first (with the control plane) first."""
        return list(self.node_cfgs)

    def node_ip(self, node: str) -> str:
        return self.node_cfgs[node].kubelet_ip

    def lose_node(self, node: str) -> None:
        """Cut a node off as a dead machine would be: its link to the island down (nothing in or out) and its
        kubelet stopped; its containers run on, unreachable. Not the first node (it holds the control plane)."""
        ncfg = self.node_cfgs[node]
        if ncfg.first_node:
            raise ClusterError("the first node holds the control plane; lose another one")
        self.stop_component("kubelet" + ncfg.node_suffix, 10)
        self._lost.add(node)
        sw = self.lab.namespaces["sw"].netns
        _run(["ip", "-n", sw, "link", "set", self._node_links[node], "down"])

    def _ctr(self, *args: str, check: bool = True, timeout: float = 120.0, input: bytes | None = None,
             node: str | None = None):
        sock = self.node_cfgs[node].containerd_socket if node else self.cfg.containerd_socket
        return _run(["ctr", "--address", str(sock), "--namespace", "k8s.io", *args],
                    check=check, timeout=timeout, input=input)

    def import_image(self, archive: str | Path) -> str:
        """Import an OCI (or docker-archive) tar into every node's containerd; ``ctr``'s output (the first's)."""
        nodes: list[str | None] = [*self.node_cfgs] or [None]
        outs = [self._ctr("images", "import", "--no-unpack=false", str(archive), node=n).stdout for n in nodes]
        return outs[0]

    def tag_image(self, source: str, target: str) -> None:
        """Another name for an image in every node's containerd (as a registry serves one image under two tags)."""
        nodes: list[str | None] = [*self.node_cfgs] or [None]
        for n in nodes:
            self._ctr("images", "tag", "--force", source, target, node=n)

    def import_image_bytes(self, data: bytes, filename: str, nodes: Sequence[str] = ()) -> str:
        p = self.cfg.run_dir / "images" / filename
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        targets: list[str | None] = [*(nodes or self.node_cfgs)] or [None]
        outs = [self._ctr("images", "import", str(p), node=n).stdout for n in targets]
        return outs[0]

    def trust_registry(self, address: str, ca_pem: bytes) -> None:
        """Every node's containerd pulls from the registry at ``address`` (host:port) over HTTPS, trusting
        ``ca_pem`` for it: certs.d/<address>/hosts.toml and its ca.crt in the node's containerd config dir (its
        ``config_path``), which containerd reads at each pull. The credentials come with each pull from the
        Pod's image pull Secret."""
        from labtools import registry
        for ncfg in self.node_cfgs.values() or [self.cfg]:
            d = ncfg.containerd_dir / "certs.d" / address
            d.mkdir(parents=True, exist_ok=True)
            (d / "ca.crt").write_bytes(ca_pem)
            (d / "hosts.toml").write_text(registry.hosts_toml(address, str(d / "ca.crt")))

    def images(self, node: str | None = None) -> list[str]:
        return [ln.split()[0] for ln in self._ctr("images", "ls", "-q", node=node).stdout.splitlines() if ln.strip()]

    def node_ready(self, node: str | None = None) -> bool:
        n = self.get("node", node or self.cfg.node_name)
        conds = (n or {}).get("status", {}).get("conditions", [])
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)

    def wait_node_ready(self, timeout: float = 60.0, node: str | None = None) -> None:
        name = node or self.cfg.node_name
        sfx = self.node_cfgs[name].node_suffix if name in self.node_cfgs else ""
        _wait(lambda: self.node_ready(name), timeout, f"node {name} Ready", 0.3,
              procs=[self.procs[n + sfx] for n in ("kubelet", "containerd") if n + sfx in self.procs])

    def dns_ready(self) -> bool:
        d = self.get("deployment", "coredns", coredns.NAMESPACE)
        return bool(((d or {}).get("status") or {}).get("readyReplicas"))

    def wait_dns(self, timeout: float = 60.0) -> None:
        """Until CoreDNS answers (its Deployment has a ready Pod); a cluster started with ``dns=False`` fails."""
        if not self.cfg.cluster_dns:
            raise ClusterError("this cluster was started without cluster DNS (dns=False)")
        t = time.monotonic()
        _wait(self.dns_ready, timeout, "CoreDNS Ready", 0.3)
        self.timings.setdefault("dns_ready_wait", time.monotonic() - t)

    def wait_pod_ready(self, namespace: str, name: str, timeout: float = 90.0) -> dict:
        def ready() -> dict | None:
            p = self.get("pod", name, namespace)
            conds = (p or {}).get("status", {}).get("conditions", [])
            return p if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds) else None
        try:
            return _wait(ready, timeout, f"pod {namespace}/{name} Ready", 0.5)
        except ClusterError as e:
            desc = self.kubectl("describe", "pod", name, "-n", namespace, check=False)
            raise ClusterError(f"{e}\n{desc.stdout[-3000:]}{desc.stderr[-500:]}") from None

    def audit(self, *, user: str | None = None, name: str | None = None) -> list[dict]:
        """The API server's audit events on Secrets (``verb``, ``objectRef``, ``responseStatus.code``, ``user``),
        and on everything for the ``audit_users`` given to start(); in the order the API server wrote them."""
        out = []
        try:
            lines = (self.cfg.run_dir / "logs" / "audit.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        for ln in lines:
            try:
                ev = json.loads(ln)
            except json.JSONDecodeError:
                continue
            if user and ev.get("user", {}).get("username") != user:
                continue
            if name and (ev.get("objectRef") or {}).get("name") != name:
                continue
            out.append(ev)
        return out

    def rss_mb(self) -> dict[str, float]:
        """Resident memory of each component (MiB), read from /proc."""
        out = {}
        for name, pr in self.procs.items():
            if name == "holder" or pr.proc.poll() is not None:
                continue
            pid = _child_pid(pr.proc.pid)
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[name] = int(line.split()[1]) / 1024
            except OSError:
                pass
        return out

    def diagnostics(self, chars: int = 4000) -> str:
        """Logs of every component (tails) and the cluster's Pods and events, for a failing test."""
        out = [f"=== cluster {self.cfg.name} run_dir={self.cfg.run_dir}"]
        for name, pr in self.procs.items():
            out.append(f"--- {name} (exit {pr.proc.poll()})\n{pr.tail(chars)}")
        if not self._closed:
            for args in (("get", "pods", "-A", "-o", "wide"), ("get", "events", "-A")):
                cp = self.kubectl(*args, check=False, timeout=20)
                out.append(f"--- kubectl {' '.join(args)}\n{cp.stdout[-chars:]}{cp.stderr[-500:]}")
        return "\n".join(out)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        problems: list[str] = []
        node_procs = [n for n in self.procs if n.startswith(("kubelet-", "kube-proxy-"))]
        for name in ("kubelet", "kube-proxy", *node_procs, "kube-scheduler", "kube-controller-manager"):
            try:
                self.stop_component(name, 10)
            except Exception as e:
                problems.append(f"{name}: {e}")
        # the Pods' processes: everything in our cgroup tree (they are in their own namespaces)
        self._kill_cgroup_tree(problems)
        for name in ("containerd", *[n for n in self.procs if n.startswith("containerd-")], "kube-apiserver", "etcd"):
            try:
                # a lost node's connections to the API server are half-open: its graceful stop would wait 15 s
                # for them, for a cluster whose data is thrown away
                self.stop_component(name, 2 if name == "kube-apiserver" and self._lost else 15)
            except Exception as e:
                problems.append(f"{name}: {e}")
        for holder in (list(self.holders.values()) or ([self.holder] if self.holder else [])):
            # the shims and anything else in the node's mount namespace, then the holder: the namespace and
            # every mount in it (Pods' netns pins, rootfs overlays, volume tmpfs) go with it
            try:
                proc = holder.proc
                mnt = os.stat(f"/proc/{proc.pid}/ns/mnt").st_ino if proc.poll() is None else None
            except OSError:
                mnt = None
            if mnt is not None:
                for pid in _pids_in_mount_ns(mnt):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            self.stop_component(holder.name, 5)
        self._kill_cgroup_tree(problems)
        self._remove_cgroups(problems)
        for pr in self.procs.values():
            try:
                pr.logf.close()
            except Exception:
                pass
        if self.lab is not None and self.netns:
            self.lab.kill_ns_leftovers("k8s", 5) if self.lab.ns_pids("k8s") else None
            # The island's end of the node's veth goes first: `ip netns del` only unlinks the name, and the
            # namespace (with the veth pair in it) lives on while anything still holds a reference, so the
            # next cluster of the same lab found `v-k8s` still on the bridge ("RTNETLINK answers: File exists").
            sw = self.lab.namespaces.get("sw")
            if sw is not None:
                _run(["ip", "-n", sw.netns, "link", "del", "v-k8s"], check=False, timeout=15)
            cp = _run(["ip", "netns", "del", self.netns], check=False, timeout=15)
            if cp.returncode != 0 and "No such file" not in cp.stderr:
                problems.append(f"ip netns del {self.netns}: {cp.stderr.strip()}")
            shutil.rmtree(Path("/etc/netns") / self.netns, ignore_errors=True)
            self.lab.namespaces.pop("k8s", None)
            for nname, netns in self._node_netns.items():
                if netns == self.netns:
                    continue
                ns_key = self._node_links[nname][2:]
                self.lab.kill_ns_leftovers(ns_key, 5) if self.lab.ns_pids(ns_key) else None
                if sw is not None:
                    _run(["ip", "-n", sw.netns, "link", "del", self._node_links[nname]], check=False, timeout=15)
                cp = _run(["ip", "netns", "del", netns], check=False, timeout=15)
                if cp.returncode != 0 and "No such file" not in cp.stderr:
                    problems.append(f"ip netns del {netns}: {cp.stderr.strip()}")
                shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)
                self.lab.namespaces.pop(ns_key, None)
        if self._made_run_dir and os.environ.get("CBPY_KEEP_RUN_DIR") != "1":
            shutil.rmtree(self.cfg.run_dir, ignore_errors=True)
        _LIVE.discard(self)
        if problems:
            print(f"kubecluster: teardown of {self.cfg.name} had problems: " + "; ".join(problems), file=sys.stderr)

    def _cgroup_pids(self) -> set[int]:
        pids: set[int] = set()
        for d in self._made_cgroups:
            if not d.exists():
                continue
            # os.walk, not rglob: a Pod's cgroup removed during the walk is skipped, not an error
            for root, _dirs, files in os.walk(d):
                if "cgroup.procs" not in files:
                    continue
                try:
                    pids.update(int(x) for x in (Path(root) / "cgroup.procs").read_text().split())
                except OSError:
                    pass
        return pids

    def _kill_cgroup_tree(self, problems: list[str]) -> None:
        for _ in range(20):
            pids = self._cgroup_pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        problems.append(f"processes left in {self.cfg.cgroup_root}: {sorted(self._cgroup_pids())}")

    def _remove_cgroups(self, problems: list[str]) -> None:
        for d in self._made_cgroups:
            if not d.exists():
                continue
            subdirs = sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
            for sd in [*subdirs, d]:
                for _ in range(20):
                    try:
                        sd.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError as e:
                        last = e
                        time.sleep(0.1)
                else:
                    problems.append(f"rmdir {sd}: {last}")


def _child_pid(pid: int) -> int:
    """nsenter/env exec the program, except nsenter --target, which forks: follow to the only child."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        if comm == "nsenter":
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if kids:
                return int(kids[0])
    except OSError:
        pass
    return pid


def _pids_in_mount_ns(ino: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.stat(d / "ns" / "mnt").st_ino == ino:
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def reap_stale(run_root: str | Path = "/tmp") -> list[str]:
    """Remove clusters whose owner process died without close() (a SIGKILLed test run): kill the processes
    of their run directory and their cgroup tree (the Pods), remove the cgroups and the run directory. Only
    clusters made by this module (an ``owner`` and a ``name`` file) are touched. Run before Lab's reap_stale,
    which then removes the lab's namespaces (the node's among them). Returns the names reaped."""
    reaped = []
    for owner in [*Path(run_root).glob("cb*/k8s/owner"), *Path(run_root).glob("cbpy-*/owner")]:
        run = owner.parent
        try:
            pid = int(owner.read_text().strip())
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] != "Z":     # a zombie owner is dead too
                continue
        except FileNotFoundError:
            pass
        except (ValueError, OSError, IndexError):
            continue
        try:
            name = (run / "name").read_text().strip()
        except OSError:
            continue
        kc = KubeCluster(ClusterConfig(name, run, run, "127.0.0.1"))
        kc._closed = True
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if str(run) + "/" in (d / "cmdline").read_bytes().decode(errors="replace"):
                        os.kill(int(d.name), signal.SIGKILL)
                except (OSError, ProcessLookupError):
                    pass
        kc._made_cgroups = [d for m in kc._cgroup_mounts()
                            for d in [m / kc.cfg.cgroup_root.lstrip("/"),
                                      *m.glob(kc.cfg.cgroup_root.lstrip("/") + "-*")]]
        problems: list[str] = []
        kc._kill_cgroup_tree(problems)
        time.sleep(0.5)
        kc._remove_cgroups(problems)
        shutil.rmtree(run, ignore_errors=True)
        reaped.append(name + (f" ({'; '.join(problems)})" if problems else ""))
    return reaped


def _close_all() -> None:
    for kc in list(_LIVE):
        try:
            kc.close()
        except Exception as e:
            print(f"kubecluster: atexit close failed: {e}", file=sys.stderr)


atexit.register(_close_all)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "reap-stale":
        print("\n".join(reap_stale()) or "(none)")
        sys.exit(0)
    print("usage: python -m labtools.kubecluster reap-stale", file=sys.stderr)
    sys.exit(2)
