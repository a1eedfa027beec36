"""A throwaway CA and leaf certificates made with the openssl CLI, for tests and benches of served TLS."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass


def _run(*args: str, cwd: str) -> str:
    return subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@dataclass(frozen=True)
class Leaf:
    cert_pem: bytes
    key_pem: bytes
    serial: str          # upper-case hex, as `openssl x509 -serial` prints it


class TestCA:
    __test__ = False     # not a pytest class

    def __init__(self, directory: str, name: str = "test CA"):
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", f"/CN={name}", cwd=directory)
        self.ca_path = os.path.join(directory, "ca.crt")
        self._n = 0

    def issue(self, *dns: str, days: int = 1, cn: str = "", not_before: str = "", not_after: str = "") -> Leaf:
        """A leaf for the DNS names `dns`; not_before/not_after as openssl's YYYYMMDDHHMMSSZ override days."""
        self._n += 1
        n, d = self._n, self.dir
        _run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"leaf{n}.key", "-out", f"leaf{n}.csr", "-subj", f"/CN={cn or (dns[0] if dns else 'leaf')}", cwd=d)
        ext = f"leaf{n}.ext"
        with open(os.path.join(d, ext), "w") as f:
            f.write("basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")
            if dns:
                f.write("subjectAltName=" + ",".join(f"DNS:{x}" for x in dns) + "\n")
        if not_before or not_after:
            _sign_with_dates(d, n, ext, not_before, not_after)
        else:
            _run("x509", "-req", "-in", f"leaf{n}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"leaf{n}.crt", "-days", str(days), "-extfile", ext, cwd=d)
        with open(os.path.join(d, f"leaf{n}.crt"), "rb") as f:
            cert = f.read()
        with open(os.path.join(d, f"leaf{n}.key"), "rb") as f:
            key = f.read()
        serial = _run("x509", "-in", f"leaf{n}.crt", "-noout", "-serial", cwd=d).strip().split("=", 1)[1]
        return Leaf(cert, key, serial.upper())


def _sign_with_dates(d: str, n: int, ext: str, not_before: str, not_after: str) -> None:
    """`openssl ca` with explicit dates (the one CLI path that takes them), in a minimal CA database."""
    db = os.path.join(d, "index.txt")
    if not os.path.exists(db):
        open(db, "w").close()
    conf = os.path.join(d, "ca.cnf")
    with open(conf, "w") as f:
        f.write(f"""[ca]
default_ca = CA
[CA]
dir = {d}
database = $dir/index.txt
new_certs_dir = $dir
certificate = $dir/ca.crt
private_key = $dir/ca.key
serial = $dir/ca.srl
default_md = sha256
policy = any
unique_subject = no
copy_extensions = none
[any]
commonName = supplied
""")
    srl = os.path.join(d, "ca.srl")
    if not os.path.exists(srl):
        with open(srl, "w") as f:
            f.write("1000\n")
    args = ["ca", "-batch", "-config", conf, "-in", f"leaf{n}.csr", "-out", f"leaf{n}.crt", "-extfile", ext,
            "-notext"]
    if not_before:
        args += ["-startdate", not_before]
    if not_after:
        args += ["-enddate", not_after]
    else:
        args += ["-days", "1"]
    _run(*args, cwd=d)
