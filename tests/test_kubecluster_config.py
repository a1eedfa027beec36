"""The real cluster's pure parts: the OCI archive of the lab's images, and the files and command lines that
labtools.kubecluster renders for each component (no root, no cluster: the cluster itself is tested in
netns-tests/test_realkube_e2e.py)."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

from labtools import kubecluster as kc
from labtools import ociimage


def _members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return {m.name: (tf.extractfile(m).read() if m.isfile() else b"") for m in tf.getmembers()}


def test_oci_archive_is_a_layout_containerd_imports_under_its_name():
    data = ociimage.oci_archive("localhost/pause:lab", [ociimage.File("pause", b"\x7fELF-binary")], ["/pause"])
    assert data == ociimage.oci_archive("localhost/pause:lab", [ociimage.File("pause", b"\x7fELF-binary")], ["/pause"])
    m = _members(data)
    assert json.loads(m["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    entry = json.loads(m["index.json"])["manifests"][0]
    assert entry["annotations"]["io.containerd.image.name"] == "localhost/pause:lab"
    # every digest is the sha256 of the blob it names
    for name, blob in m.items():
        if name.startswith("blobs/sha256/") and blob:
            assert hashlib.sha256(blob).hexdigest() == name.rsplit("/", 1)[1]
    manifest = json.loads(m["blobs/sha256/" + entry["digest"].split(":")[1]])
    config = json.loads(m["blobs/sha256/" + manifest["config"]["digest"].split(":")[1]])
    assert config["config"]["Entrypoint"] == ["/pause"]
    layer = _members(m["blobs/sha256/" + manifest["layers"][0]["digest"].split(":")[1]])
    assert layer["pause"] == b"\x7fELF-binary"


def _cfg(tmp_path: Path) -> kc.ClusterConfig:
    return kc.ClusterConfig("t1", tmp_path / "run", tmp_path / "bin", "10.99.0.50", token="tok")


def test_the_apiserver_certificate_covers_every_name_pods_and_the_island_use(tmp_path):
    cfg = _cfg(tmp_path)
    api = next(s for s in kc.cert_plan(cfg) if s.name == "apiserver")
    for san in (
        "IP:10.99.0.50",
        "IP:10.96.0.1",
        "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local",
    ):
        assert san in api.sans
    node = next(s for s in kc.cert_plan(cfg) if s.name == "kubelet-client")
    assert (node.cn, node.org) == ("system:node:knode", "system:nodes")
    ext = kc.openssl_ext(api)
    assert "CA:FALSE" in ext and "serverAuth" in ext and "clientAuth" not in ext


def test_components_are_configured_for_this_machine(tmp_path):
    cfg = _cfg(tmp_path)
    api = kc.apiserver_argv(cfg)
    assert "--bind-address=10.99.0.50" in api and "--advertise-address=10.99.0.50" in api
    assert "--authorization-mode=Node,RBAC" in api
    assert "--service-account-issuer=https://kubernetes.default.svc" in api
    # several clusters side by side: no fixed serving ports, no leader election
    for argv in (kc.controller_manager_argv(cfg), kc.scheduler_argv(cfg)):
        assert "--secure-port=0" in argv and "--leader-elect=false" in argv
    ctd = kc.containerd_config(cfg)
    assert "restrict_oom_score_adj = true" in ctd and "SystemdCgroup = false" in ctd
    assert f'address = "{cfg.containerd_socket}"' in ctd and str(cfg.run_dir) in ctd
    kl = kc.kubelet_config(cfg)
    assert kl["cgroupDriver"] == "cgroupfs" and kl["cgroupRoot"] == "/cbpy-t1"
    assert kl["address"] == "10.99.0.50" and kl["authentication"]["anonymous"]["enabled"] is False
    assert kc.kube_proxy_config(cfg)["mode"] == "iptables"
    cni = kc.cni_conflist(cfg, "10.244.0.0/24")
    bridge = cni["plugins"][0]
    assert bridge["ipMasq"] and bridge["ipam"]["ranges"][0][0] == {"subnet": "10.244.0.0/24", "gateway": "10.244.0.1"}
    assert "mount -t tmpfs -o mode=755 tmpfs /run" in kc.holder_script(cfg)


def test_control_plane_options_default_to_the_lab_cluster_and_add_only_what_is_asked(tmp_path):
    base = _cfg(tmp_path)
    # defaults: one service range, Secrets audited only, kube-controller-manager's own controller set
    assert base.kubernetes_service_ip == "10.96.0.1"
    assert kc.audit_policy(base) == kc.AUDIT_POLICY
    assert not any(a.startswith("--controllers") for a in kc.controller_manager_argv(base))
    user = "system:serviceaccount:tailscale:tailscale-controller"
    opt = kc.ClusterConfig("t1", tmp_path / "run", tmp_path / "bin", "127.0.0.1", token="tok",
                           service_cidr="10.96.0.0/16,fd00:10:96::/108", audit_users=(user,),
                           controllers=("garbagecollector", "serviceaccount"))
    assert opt.kubernetes_service_ip == "10.96.0.1"          # the primary (first) family's first address
    assert "--service-cluster-ip-range=10.96.0.0/16,fd00:10:96::/108" in kc.apiserver_argv(opt)
    assert "--controllers=garbagecollector,serviceaccount" in kc.controller_manager_argv(opt)
    rules = kc.audit_policy(opt)["rules"]
    # that user's every request first, once per request (no ResponseStarted for watches); Secrets as before
    assert rules[0] == {"level": "Metadata", "users": [user], "omitStages": ["RequestReceived", "ResponseStarted"]}
    assert rules[1:] == kc.AUDIT_POLICY["rules"]


def test_the_kubelet_points_pods_at_the_cluster_dns_only_when_there_is_one(tmp_path):
    import dataclasses
    cfg = _cfg(tmp_path)
    assert "clusterDNS" not in kc.kubelet_config(cfg)
    with_dns = dataclasses.replace(cfg, cluster_dns="10.96.0.10")
    assert kc.kubelet_config(with_dns)["clusterDNS"] == ["10.96.0.10"]
    assert kc.kubelet_config(with_dns)["clusterDomain"] == "cluster.local"


def test_a_second_node_has_its_own_identity_address_files_and_cgroup(tmp_path):
    from dataclasses import replace
    cfg = replace(_cfg(tmp_path), extra_nodes=(("knode2", "10.99.0.51"),), spread_pods=True)
    certs = {s.name: s for s in kc.cert_plan(cfg)}
    assert (certs["kubelet-client-knode2"].cn, certs["kubelet-client-knode2"].org) == ("system:node:knode2",
                                                                                       "system:nodes")
    assert certs["kubelet-serving-knode2"].sans == ("IP:10.99.0.51", "DNS:knode2")
    n2 = kc.node_config(cfg, "knode2", "10.99.0.51")
    argv = kc.kubelet_argv(n2)
    assert "--node-ip=10.99.0.51" in argv and "--hostname-override=knode2" in argv
    assert f"--kubeconfig={cfg.kubeconfig_path('kubelet-knode2')}" in argv
    conf = kc.kubelet_config(n2)
    assert conf["address"] == "10.99.0.51" and conf["tlsCertFile"].endswith("kubelet-serving-knode2.crt")
    # nothing of the second node's runtime is shared with the first's
    first = kc.kubelet_config(cfg)
    assert first["address"] == "10.99.0.50" and first["cgroupRoot"] == "/cbpy-t1"
    assert conf["cgroupRoot"] == "/cbpy-t1-knode2" and n2.containerd_socket != cfg.containerd_socket
    assert str(cfg.containerd_socket) not in kc.containerd_config(n2)
    assert kc.cni_conflist(n2, "10.244.1.0/24")["plugins"][0]["ipam"]["dataDir"].startswith(str(n2.node_run_dir))
    # the scheduler spreads a workload's Pods over the nodes, as a hard rule
    sched = kc.scheduler_config(cfg)
    spread = sched["profiles"][0]["pluginConfig"][0]["args"]["defaultConstraints"]
    assert spread == [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule"}]
    assert any(a.startswith("--config=") for a in kc.scheduler_argv(cfg))
    # node-loss timing: Kubernetes' defaults unless the cluster is started with other values
    assert not any(a.startswith("--node-monitor") for a in kc.controller_manager_argv(cfg))
    assert not any("toleration-seconds" in a for a in kc.apiserver_argv(cfg))
    short = replace(cfg, node_loss=kc.SHORT_NODE_LOSS)
    assert "--node-monitor-grace-period=20s" in kc.controller_manager_argv(short)
    assert "--default-unreachable-toleration-seconds=5" in kc.apiserver_argv(short)
