"""Tiny OCI image archives made in Python, for the lab's real cluster where no registry is reachable.

``oci_archive(name, files, entrypoint)`` returns the bytes of an OCI image layout tar (``oci-layout``,
``index.json``, ``blobs/sha256/...``) holding one image with one uncompressed layer, which
``ctr -n k8s.io images import`` accepts: the index entry carries the ``io.containerd.image.name`` annotation
(the name the kubelet asks for) besides ``org.opencontainers.image.ref.name``. Pure: the same input gives the
same bytes (fixed timestamps and owners), so an archive can be cached by content.

Used for the Pods' sandbox image (the ``pause`` program built by scripts/install-kubernetes.sh).
"""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True)
class File:
    """One regular file of a layer: its path in the image (no leading slash), content and mode."""
    path: str
    data: bytes
    mode: int = 0o755


def _tar(entries: Iterable[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in entries:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _info(name: str, *, size: int = 0, mode: int = 0o644, kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.type, ti.mtime, ti.uid, ti.gid = size, mode, kind, 0, 0, 0
    ti.uname = ti.gname = "root"
    return ti


def layer_tar(files: Sequence[File]) -> bytes:
    """An uncompressed layer with ``files`` and their parent directories."""
    dirs: list[str] = []
    for f in files:
        parts = f.path.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in dirs:
                dirs.append(d)
    entries: list[tuple[tarfile.TarInfo, bytes | None]] = [
        (_info(d + "/", mode=0o755, kind=tarfile.DIRTYPE), None) for d in sorted(dirs)]
    for f in sorted(files, key=lambda f: f.path):
        entries.append((_info(f.path.strip("/"), size=len(f.data), mode=f.mode), f.data))
    return _tar(entries)


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def oci_archive(name: str, files: Sequence[File], entrypoint: Sequence[str], *,
                env: Mapping[str, str] | None = None, arch: str = "amd64", user: str = "") -> bytes:
    """An OCI image layout tar holding the image ``name`` (e.g. ``localhost/pause:lab``); ``user``: the image's
    user (a numeric UID lets a Pod with ``runAsNonRoot`` run it)."""
    layer = layer_tar(files)
    layer_digest, _ = _blob(layer)
    config = {
        "architecture": arch, "os": "linux",
        "config": {"Entrypoint": list(entrypoint),
                   "Env": [f"{k}={v}" for k, v in (env or {"PATH": "/usr/local/bin:/usr/bin:/bin"}).items()],
                   **({"User": user} if user else {})},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": "labtools.ociimage"}],
    }
    cfg_digest, cfg = _blob(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest, "size": len(cfg)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest,
                    "size": len(layer)}],
    }
    man_digest, man = _blob(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
    index = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": man_digest,
                       "size": len(man), "platform": {"architecture": arch, "os": "linux"},
                       "annotations": {"io.containerd.image.name": name,
                                       "org.opencontainers.image.ref.name": name.rpartition(":")[2]}}],
    }
    blobs = {d: b for d, b in (_blob(layer), (cfg_digest, cfg), (man_digest, man))}
    entries: list[tuple[tarfile.TarInfo, bytes | None]] = []
    layout = json.dumps({"imageLayoutVersion": "1.0.0"}).encode()
    idx = json.dumps(index, sort_keys=True, separators=(",", ":")).encode()
    entries.append((_info("oci-layout", size=len(layout)), layout))
    entries.append((_info("index.json", size=len(idx)), idx))
    entries.append((_info("blobs/", mode=0o755, kind=tarfile.DIRTYPE), None))
    entries.append((_info("blobs/sha256/", mode=0o755, kind=tarfile.DIRTYPE), None))
    for d, b in sorted(blobs.items()):
        entries.append((_info("blobs/sha256/" + d.split(":", 1)[1], size=len(b)), b))
    return _tar(entries)
