"""A stand-in for the kubelet's atomic writer of ConfigMap and Secret volumes (the ``..data`` swap)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path


class Kubelet:
    """Mimics kubelet's atomic writer for a ConfigMap/Secret volume."""

    def __init__(self, root: Path, key: str = "serve-config"):
        self.root, self.key, self.n = root, key, 0
        root.mkdir(parents=True, exist_ok=True)

    def publish(self, content: str) -> None:
        self.n += 1
        ts = self.root / f"..2026_11_21_22_00_{self.n:02d}.{self.n:09d}"
        ts.mkdir()
        (ts / self.key).write_text(content)
        old = os.readlink(self.root / "..data") if (self.root / "..data").is_symlink() else None
        tmp = self.root / "..data_tmp"
        os.symlink(ts.name, tmp)
        os.rename(tmp, self.root / "..data")       # the atomic swap
        link = self.root / self.key
        if not link.is_symlink():
            os.symlink(f"..data/{self.key}", link)
        if old:
            shutil.rmtree(self.root / old)

    @property
    def path(self) -> str:
        return str(self.root / self.key)
