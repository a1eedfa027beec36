"""The lab registry's files, as the registry, containerd and the kubelet read them (labtools/registry.py).

The running registry (push and pull with the password, refused without) is netns-tests/test_registry.py; here
the pure parts: the registry's config.yml parsed as YAML says TLS + htpasswd and listens where asked only;
containerd's hosts.toml parsed as TOML trusts the CA for that host; the pull Secret decodes to the credentials.
"""
from __future__ import annotations

import base64
import json
import tomllib
from pathlib import Path

import yaml

from labtools import registry


def test_config_listens_only_where_asked_with_tls_and_htpasswd(tmp_path: Path):
    files = registry.RegistryFiles(tmp_path)
    cfg = yaml.safe_load(registry.config_yml(files, "10.99.0.50:5000", "s3cret"))
    assert cfg["http"]["addr"] == "10.99.0.50:5000"
    assert cfg["http"]["tls"] == {"certificate": str(tmp_path / "pki" / "registry.crt"),
                                  "key": str(tmp_path / "pki" / "registry.key")}
    assert cfg["auth"] == {"htpasswd": {"realm": registry.REALM, "path": str(tmp_path / "htpasswd")}}
    assert cfg["storage"]["filesystem"]["rootdirectory"] == str(tmp_path / "data")
    # nothing else listens: no debug server, no metrics endpoint
    assert "debug" not in cfg["http"] and "prometheus" not in json.dumps(cfg)


def test_config_paths_with_yaml_specials_stay_strings(tmp_path: Path):
    odd = tmp_path / "a: b #c"
    cfg = yaml.safe_load(registry.config_yml(registry.RegistryFiles(odd), "127.0.0.1:1", "x: y"))
    assert cfg["storage"]["filesystem"]["rootdirectory"] == str(odd / "data")
    assert cfg["http"]["secret"] == "x: y"


def test_hosts_toml_trusts_the_ca_for_that_registry_only():
    doc = tomllib.loads(registry.hosts_toml("10.99.0.50:5000", "/etc/containerd/certs.d/10.99.0.50:5000/ca.crt"))
    assert doc["server"] == "https://10.99.0.50:5000"
    host = doc["host"]["https://10.99.0.50:5000"]
    assert host["ca"] == "/etc/containerd/certs.d/10.99.0.50:5000/ca.crt"
    assert host["capabilities"] == ["pull", "resolve"]   # never push from a node
    assert "skip_verify" not in host


def test_pull_secret_decodes_to_the_credentials():
    doc = json.loads(registry.dockerconfigjson("reg.lab:5000", "lab", "p@ss:word"))
    entry = doc["auths"]["reg.lab:5000"]
    assert base64.b64decode(entry["auth"]).decode() == "lab:p@ss:word"
    assert (entry["username"], entry["password"]) == ("lab", "p@ss:word")


def test_certificate_names_the_address():
    assert registry.san_for("10.99.0.50") == "IP:10.99.0.50"
    assert registry.san_for("fd7a::1") == "IP:fd7a::1"
    assert registry.san_for("registry.lab") == "DNS:registry.lab"
