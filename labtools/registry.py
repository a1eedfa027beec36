"""The lab's container registry: the CNCF registry (distribution v3.0.0, built by scripts/install-registry.sh)
with TLS from a private CA the lab makes and htpasswd basic auth, configured as a homelab registry is.

API::

    from labtools.registry import LabRegistry
    # on the host's loopback, a free port (no root needed); or in a network namespace on its address:
    with LabRegistry.start(run_dir) as reg: ...
    reg = LabRegistry.start(run_dir, host="10.99.0.50", port=5000, netns="cbpy-k8s")
    reg = LabRegistry.start(run_dir, netns="cbreg1", new_netns=True)   # 127.0.0.1:5000 in a namespace of its own
    reg.address                  # "127.0.0.1:41234": what image references start with
    reg.ca_cert                  # the CA certificate clients trust (PEM file)
    reg.cert_dir                 # a directory holding ca.crt (podman/skopeo --cert-dir)
    reg.username, reg.password   # the one htpasswd user
    reg.authfile                 # containers-auth.json / docker config.json with the credentials (podman, helm)
    reg.run(argv)                # a client command where the registry is reachable (its network namespace)
    reg.fetch_json("/v2/<name>/manifests/<tag>", accept)   # (document, digest) with the credentials
    reg.close()                  # the process stopped, its directory removed

The pure parts (the registry's config.yml, containerd's hosts.toml, the image pull Secret's
``.dockerconfigjson``) are functions of their inputs, tested without a registry (tests/test_registry_config.py).

Why so: the registry listens on loopback or a lab namespace's address only (never the host's network); its TLS
certificate names the address it listens on (clients check it against the lab's CA, as a cluster checks a
homelab registry's); every request needs the user's password (``auth.htpasswd``; bcrypt hashes written by
Apache's ``htpasswd -B``, which the registry requires); storage is a directory of the run, thrown away at close.
"""
from __future__ import annotations

import base64
import ipaddress
import json
import os
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from labtools.lab import stop_process

REGISTRY_VERSION = "v3.0.0"
USERNAME = "lab"
#: what a client accepts for an image index, and for an image manifest (OCI and Docker media types)
INDEX = "application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"
REALM = "containerboot-py lab registry"
REPO = Path(__file__).resolve().parent.parent


class RegistryError(RuntimeError):
    pass


@dataclass(frozen=True)
class RegistryFiles:
    """Where one registry's files are (all under its run directory)."""
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def config(self) -> Path:
        return self.root / "config.yml"

    @property
    def htpasswd(self) -> Path:
        return self.root / "htpasswd"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def cert_dir(self) -> Path:
        return self.root / "certs"

    @property
    def authfile(self) -> Path:
        return self.root / "auth.json"

    @property
    def log(self) -> Path:
        return self.root / "registry.log"


def _yaml_str(s: str) -> str:
    return json.dumps(s)   # a JSON string is a YAML scalar with every character escaped


def config_yml(files: RegistryFiles, address: str, http_secret: str) -> str:
    """The registry's config.yml: TLS from the lab's CA, htpasswd auth, filesystem storage, deletes allowed
    (so a test can remove what it pushed), no debug or metrics listener (nothing but ``address`` listens)."""
    return "\n".join([
        "version: 0.1",
        "log:",
        "  level: info",
        "  formatter: text",
        "storage:",
        "  filesystem:",
        f"    rootdirectory: {_yaml_str(str(files.data))}",
        "  delete:",
        "    enabled: true",
        "  maintenance:",
        "    uploadpurging:",
        "      enabled: false",
        "http:",
        f"  addr: {_yaml_str(address)}",
        f"  secret: {_yaml_str(http_secret)}",
        "  tls:",
        f"    certificate: {_yaml_str(str(files.pki / 'registry.crt'))}",
        f"    key: {_yaml_str(str(files.pki / 'registry.key'))}",
        "  headers:",
        "    X-Content-Type-Options: [nosniff]",
        "auth:",
        "  htpasswd:",
        f"    realm: {_yaml_str(REALM)}",
        f"    path: {_yaml_str(str(files.htpasswd))}",
        "",
    ])


def hosts_toml(address: str, ca_path: str) -> str:
    """containerd's hosts.toml for ``address`` (certs.d/<address>/hosts.toml): pull and resolve over HTTPS,
    trusting only the lab's CA for it. The credentials are not here: the kubelet passes the Pod's image pull
    Secret with each pull."""
    return (f'server = "https://{address}"\n\n'
            f'[host."https://{address}"]\n'
            '  capabilities = ["pull", "resolve"]\n'
            f'  ca = {json.dumps(ca_path)}\n')


def dockerconfigjson(address: str, username: str, password: str) -> str:
    """The ``.dockerconfigjson`` of a ``kubernetes.io/dockerconfigjson`` Secret (also podman's and helm's auth
    file format) for one registry."""
    auth = base64.b64encode(f"{username}:{password}".encode()).decode()
    return json.dumps({"auths": {address: {"username": username, "password": password, "auth": auth}}})


def san_for(host: str) -> str:
    """The subjectAltName entry naming ``host`` (an IP address or a DNS name)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return f"DNS:{host}"
    return f"IP:{host}"


def binary_path() -> Path:
    out = subprocess.run(["bash", str(REPO / "scripts" / "install-registry.sh"), "--print-path"],
                         capture_output=True, text=True, check=True).stdout.split()
    return Path(out[-1])


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _openssl(*args: str) -> None:
    cp = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=30)
    if cp.returncode != 0:
        raise RegistryError(f"openssl {args[0]} failed: {cp.stderr.strip()}")


def write_pki(pki: Path, host: str, extra_names: Sequence[str] = ()) -> None:
    """A private CA (ca.crt, ca.key) and the registry's serving certificate for ``host`` signed by it."""
    pki.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (pki / "ca.cnf").write_text("[req]\ndistinguished_name = dn\nx509_extensions = ext\nprompt = no\n[dn]\n"
                                "CN = unused\n[ext]\nbasicConstraints = critical,CA:TRUE\n"
                                "keyUsage = critical,keyCertSign,cRLSign\nsubjectKeyIdentifier = hash\n")
    _openssl("req", "-x509", "-new", "-config", str(pki / "ca.cnf"), *ec, "-keyout", str(pki / "ca.key"),
             "-out", str(pki / "ca.crt"), "-days", "30", "-subj", "/CN=containerboot-py lab registry CA")
    sans = ",".join(san_for(h) for h in (host, *extra_names))
    (pki / "registry.cnf").write_text(
        "[req]\ndistinguished_name = dn\nx509_extensions = ext\nprompt = no\n[dn]\nCN = unused\n[ext]\n"
        "basicConstraints = critical,CA:FALSE\nkeyUsage = critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage = serverAuth\nsubjectKeyIdentifier = hash\nauthorityKeyIdentifier = keyid\n"
        f"subjectAltName = {sans}\n")
    _openssl("req", "-x509", "-new", "-config", str(pki / "registry.cnf"), *ec,
             "-keyout", str(pki / "registry.key"), "-out", str(pki / "registry.crt"), "-days", "30",
             "-subj", "/CN=containerboot-py lab registry", "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"))
    for f in ("ca.key", "registry.key"):
        (pki / f).chmod(0o600)


def write_htpasswd(path: Path, username: str, password: str) -> None:
    """One bcrypt entry (the registry accepts no other hash), the password read from stdin (never on argv)."""
    if not shutil.which("htpasswd"):
        raise RegistryError("htpasswd is missing (Debian's apache2-utils): run scripts/setup.sh --binaries=registry")
    cp = subprocess.run(["htpasswd", "-i", "-B", "-c", str(path), username], input=password, text=True,
                        capture_output=True, timeout=30)
    if cp.returncode != 0:
        raise RegistryError(f"htpasswd failed: {cp.stderr.strip()}")
    path.chmod(0o600)


class LabRegistry:
    """One running registry (see the module docstring)."""

    def __init__(self, files: RegistryFiles, host: str, port: int, netns: str | None,
                 proc: subprocess.Popen, password: str, own_netns: bool = False) -> None:
        self.files, self.host, self.port, self.netns = files, host, port, netns
        self.proc, self.password, self.username = proc, password, USERNAME
        self.own_netns = own_netns

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def ca_cert(self) -> Path:
        return self.files.pki / "ca.crt"

    @property
    def cert_dir(self) -> Path:
        return self.files.cert_dir

    @property
    def authfile(self) -> Path:
        return self.files.authfile

    def ns_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns] if self.netns else []

    def run(self, argv: Sequence[str], *, timeout: float = 600.0, check: bool = True,
            input: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A client command where the registry is reachable; a failure raises with its output."""
        cp = subprocess.run([*self.ns_prefix(), *argv], capture_output=True, text=True, timeout=timeout,
                            input=input, env=env)
        if check and cp.returncode != 0:
            raise RegistryError(f"{' '.join(argv[:3])} ... failed (exit {cp.returncode}): {cp.stdout}{cp.stderr}")
        return cp

    def fetch(self, path: str, accept: str = "") -> tuple[int, dict[str, str], bytes]:
        """GET ``path`` with the credentials: (HTTP status, headers in lower case, body)."""
        argv = ["curl", "-sS", "-K", "-", "-D", "-", "--cacert", str(self.ca_cert), f"https://{self.address}{path}"]
        if accept:
            argv[1:1] = ["-H", f"Accept: {accept}"]
        cp = subprocess.run([*self.ns_prefix(), *argv], capture_output=True, timeout=60,
                            input=f'user = "{self.username}:{self.password}"\n'.encode())
        if cp.returncode != 0:
            raise RegistryError(f"GET {path} failed: {cp.stderr.decode(errors='replace')}")
        head, _, body = cp.stdout.partition(b"\r\n\r\n")
        lines = head.decode(errors="replace").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        return int(lines[0].split()[1]), headers, body

    def fetch_json(self, path: str, accept: str = "") -> tuple[dict, str]:
        """A manifest, index or config: the parsed body and its digest (Docker-Content-Digest, if any)."""
        code, headers, body = self.fetch(path, accept)
        if code != 200:
            raise RegistryError(f"GET {path}: HTTP {code}: {body[:300]!r}")
        return json.loads(body), headers.get("docker-content-digest", "")

    def tag(self, repo: str, digest: str, tag: str) -> None:
        """Tag the manifest or index ``repo@digest`` as ``repo:tag`` (its bytes put again under the tag: the
        digest stays the same, as ``crane tag`` does)."""
        code, headers, body = self.fetch(f"/v2/{repo}/manifests/{digest}", f"{INDEX}, {MANIFEST}")
        if code != 200:
            raise RegistryError(f"GET {repo}@{digest}: HTTP {code}: {body[:300]!r}")
        media = headers.get("content-type", "")
        argv = ["curl", "-sS", "-K", "-", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", str(self.ca_cert),
                "-X", "PUT", "-H", f"Content-Type: {media}", "--data-binary", f"@{self.files.root / 'put.json'}",
                f"https://{self.address}/v2/{repo}/manifests/{tag}"]
        (self.files.root / "put.json").write_bytes(body)
        cp = self.run(argv, check=False, timeout=60, input=f'user = "{self.username}:{self.password}"\n')
        if cp.stdout.strip() != "201":
            raise RegistryError(f"PUT {repo}:{tag}: HTTP {cp.stdout.strip()} {cp.stderr.strip()}")

    def status(self, path: str = "/v2/", *, auth: bool) -> int:
        """The HTTP status of a GET on the registry, with or without the credentials (curl, trusting the CA)."""
        argv = ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", str(self.ca_cert),
                f"https://{self.address}{path}"]
        if auth:   # the credentials through a config on stdin, not on argv
            argv[1:1] = ["-K", "-"]
            cfg = f'user = "{self.username}:{self.password}"\n'
        else:
            cfg = None
        cp = self.run(argv, check=False, timeout=30, input=cfg)
        return int(cp.stdout.strip() or "0")

    @classmethod
    def start(cls, run_dir: Path, *, host: str = "127.0.0.1", port: int = 0, netns: str | None = None,
              new_netns: bool = False, names: Sequence[str] = (), binary: Path | None = None,
              timeout: float = 30.0) -> "LabRegistry":
        """Start a registry listening on host:port (port 0: a free one on the host, 5000 in a namespace), in
        network namespace ``netns`` if given (made here with its loopback up, and removed at close, with
        ``new_netns``)."""
        binary = binary or binary_path()
        if not binary.exists():
            raise RegistryError(f"the registry is not built: run scripts/install-registry.sh (expected {binary})")
        if new_netns:
            if not netns:
                raise RegistryError("new_netns needs the namespace's name (netns=...)")
            subprocess.run(["ip", "netns", "add", netns], check=True, capture_output=True)
            subprocess.run(["ip", "-n", netns, "link", "set", "lo", "up"], check=True, capture_output=True)
        try:
            return cls._start(run_dir, host, port, netns, new_netns, names, binary, timeout)
        except BaseException:
            if new_netns:
                subprocess.run(["ip", "netns", "del", str(netns)], check=False, capture_output=True)
            raise

    @classmethod
    def _start(cls, run_dir: Path, host: str, port: int, netns: str | None, new_netns: bool,
               names: Sequence[str], binary: Path, timeout: float) -> "LabRegistry":
        if port == 0:
            if netns:
                port = 5000
            else:
                port = _free_port(host)
        files = RegistryFiles(Path(run_dir) / f"registry-{port}")
        if files.root.exists():
            shutil.rmtree(files.root)
        files.root.mkdir(parents=True)
        files.data.mkdir()
        write_pki(files.pki, host, names)
        password = secrets.token_urlsafe(18)
        write_htpasswd(files.htpasswd, USERNAME, password)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        files.config.write_text(config_yml(files, address, secrets.token_hex(16)))
        files.cert_dir.mkdir()
        shutil.copy(files.pki / "ca.crt", files.cert_dir / "ca.crt")
        files.authfile.write_text(dockerconfigjson(address, USERNAME, password))
        files.authfile.chmod(0o600)
        env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "OTEL_SDK_DISABLED": "true"}
        log = files.log.open("ab")
        prefix = ["ip", "netns", "exec", netns] if netns else []
        proc = subprocess.Popen([*prefix, str(binary), "serve", str(files.config)], stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()
        reg = cls(files, host, port, netns, proc, password, own_netns=False)
        deadline = time.monotonic() + timeout
        while reg.status(auth=False) != 401:
            if proc.poll() is not None or time.monotonic() > deadline:
                reg.close(keep=True)
                raise RegistryError(f"the registry did not answer on {address} within {timeout}s "
                                    f"(exit {proc.returncode}); its log: {files.log}\n"
                                    + files.log.read_text(errors="replace")[-2000:])
            time.sleep(0.2)
        reg.own_netns = new_netns
        return reg

    def log_text(self) -> str:
        return self.files.log.read_text(errors="replace")

    def close(self, keep: bool = False) -> None:
        stop_process(self.proc)
        if not keep:
            shutil.rmtree(self.files.root, ignore_errors=True)
        if self.own_netns and self.netns:
            subprocess.run(["ip", "netns", "del", self.netns], check=False, capture_output=True)
            self.own_netns = False

    def __enter__(self) -> "LabRegistry":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
