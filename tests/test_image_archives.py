"""The multi-platform image archives of `make images-archives` (images/release.sh --offline), checked as a
registry's client would see them: each archive is one image named <registry>/<name>:<tag>, its config says the
platform's architecture, its binaries (tailscaled, the Python interpreter) are of that architecture's ELF
machine type, and the image runs: on this machine natively, and another architecture's under qemu user mode
(binfmt_misc), each image's own programs answering (`tailscale version`, the agent's and the controller's
Python packages importing).

The archives take minutes to build (a foreign architecture's RUN steps are emulated) and the checks run them
under emulation, so this module is kept out of `make test`: `make images-archives` builds them and runs it
(CB_RELEASE_DIR, CB_RELEASE_REGISTRY and CB_RELEASE_PLATFORMS say where and what); elsewhere it skips with
that reason, and fails when CB_RELEASE_DIR names a directory without them.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import platform
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from labtools import helmchart

REPO = Path(__file__).resolve().parents[1]
TAG = helmchart.chart_meta()["appVersion"]
REGISTRY = os.environ.get("CB_RELEASE_REGISTRY", "registry.example.com/tailscale")
PLATFORMS = os.environ.get("CB_RELEASE_PLATFORMS", "linux/amd64,linux/arm64").split(",")
CACHE = Path(os.environ.get("CB_CACHE", Path.home() / ".cache" / "containerboot-py"))
OUT = Path(os.environ.get("CB_RELEASE_DIR") or CACHE / "images" / "release" / TAG)
NAMES = ("containerboot-py", "containerboot-py-controller")
#: ELF e_machine of each architecture
ELF_MACHINE = {"amd64": 62, "arm64": 183}
#: files whose architecture is checked, per image (the interpreter the venv links to, and tailscaled)
BINARIES = {"containerboot-py": ("usr/local/bin/tailscaled", "usr/bin/python3.11"),
            "containerboot-py-controller": ("usr/bin/python3.11",)}
NATIVE = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())

CASES = [(n, p.split("/", 1)[1]) for p in PLATFORMS for n in NAMES]


def archive(name: str, arch: str) -> Path:
    return OUT / f"{name}-{TAG}-linux-{arch}.oci.tar"


@pytest.fixture(scope="module", autouse=True)
def archives_exist():
    if "CB_RELEASE_DIR" not in os.environ:
        pytest.skip("the image archives are checked by make images-archives (CB_RELEASE_DIR unset)")
    missing = [str(archive(n, a)) for n, a in CASES if not archive(n, a).is_file()]
    assert not missing, f"no image archives ({missing[0]} ...): make images-archives builds them"


class Layout:
    """An OCI image layout tar: its index, the one image's manifest, config and layers."""

    def __init__(self, path: Path) -> None:
        self.tar = tarfile.open(path)
        self.index = self.json("index.json")
        (self.entry,) = self.index["manifests"]
        self.manifest = self.json(self.blob_name(self.entry["digest"]))
        self.config = self.json(self.blob_name(self.manifest["config"]["digest"]))

    @staticmethod
    def blob_name(digest: str) -> str:
        algo, _, hexd = digest.partition(":")
        return f"blobs/{algo}/{hexd}"

    def read(self, name: str) -> bytes:
        f = self.tar.extractfile(name)
        assert f is not None, name
        return f.read()

    def json(self, name: str) -> dict:
        return json.loads(self.read(name))

    def file(self, path: str) -> bytes:
        """A regular file's content in the image (the top-most layer holding it; symlinks followed)."""
        for _ in range(8):
            found = None
            for layer in reversed(self.manifest["layers"]):
                data = self.read(self.blob_name(layer["digest"]))
                if data[:2] == b"\x1f\x8b":
                    data = gzip.decompress(data)
                with tarfile.open(fileobj=io.BytesIO(data)) as lt:
                    for m in lt.getmembers():
                        if m.name.lstrip("./") == path:
                            found = m, lt.extractfile(m).read() if m.isreg() else b""
                if found:
                    break
            assert found, f"{path} is not in the image"
            m, content = found
            if m.issym():
                path = os.path.normpath(os.path.join(os.path.dirname(path), m.linkname)).lstrip("/")
                continue
            return content
        raise AssertionError(f"{path}: too many symlinks")


@pytest.mark.parametrize("name,arch", CASES)
def test_archive_names_the_registry_image_and_its_platform(name, arch):
    img = Layout(archive(name, arch))
    ann = img.entry.get("annotations") or {}
    refs = {ann.get("org.opencontainers.image.ref.name", ""), ann.get("io.containerd.image.name", "")}
    assert f"{REGISTRY}/{name}:{TAG}" in refs or TAG in refs, ann
    assert (img.config["os"], img.config["architecture"]) == ("linux", arch)
    labels = img.config.get("config", {}).get("Labels") or {}
    assert labels.get("org.opencontainers.image.version") == helmchart.project_version()


@pytest.mark.parametrize("name,arch", CASES)
def test_binaries_are_of_the_platforms_machine_type(name, arch):
    img = Layout(archive(name, arch))
    for path in BINARIES[name]:
        elf = img.file(path)
        assert elf[:4] == b"\x7fELF", path
        machine = int.from_bytes(elf[18:20], "little")
        assert machine == ELF_MACHINE[arch], f"{path}: ELF machine {machine}, want {ELF_MACHINE[arch]} ({arch})"


def _qemu_ready(arch: str) -> str:
    """'' when this machine runs `arch` programs (natively or through binfmt_misc), else why not."""
    if arch == NATIVE:
        return ""
    q = {"arm64": "aarch64", "amd64": "x86_64"}[arch]
    entry = Path(f"/proc/sys/fs/binfmt_misc/qemu-{q}")
    if not entry.is_file():
        return f"binfmt_misc has no qemu-{q} entry (scripts/setup.sh --multiarch, then images/release.sh registers it)"
    return "" if entry.read_text().startswith("enabled") else f"{entry} is disabled"


@pytest.mark.parametrize("name,arch", CASES)
def test_image_runs_on_its_platform(name, arch, tmp_path):
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    why = _qemu_ready(arch)
    if why:
        pytest.skip(f"cannot run {arch} programs here: {why}")
    common = subprocess.run(["bash", "-c", f". {REPO}/images/common.sh; oci_runtime; run_ulimits"],
                            capture_output=True, text=True, check=True).stdout.split("\n", 1)
    runtime, ulimits = common[0].strip(), common[1].split()
    loaded = subprocess.run(["podman", "load", "-q", "-i", str(archive(name, arch))], capture_output=True,
                            text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    ref = loaded.stdout.strip().rsplit("Loaded image:", 1)[-1].strip().split(",")[0].strip()
    checks = [["--entrypoint", "/opt/venv/bin/python", ref, "-c",
               "import platform, controller.reconcile, kopf; print(platform.machine())"]]
    if name == "containerboot-py":
        checks = [["--entrypoint", "/usr/local/bin/tailscale", ref, "version"],
                  ["--entrypoint", "/opt/venv/bin/python", ref, "-c",
                   "import platform, containerboot.agent, netfilter.plan; print(platform.machine())"]]
    try:
        for argv in checks:
            cp = subprocess.run(["podman", "--runtime", runtime, "run", "--rm", "--network", "none",
                                 "--platform", f"linux/{arch}", *ulimits, *argv],
                                capture_output=True, text=True, timeout=300)
            assert cp.returncode == 0, f"{argv}: {cp.stderr[-2000:]}"
            out = cp.stdout.strip()
            print(f"{name} linux/{arch} {argv[1]}: {out.splitlines()[0] if out else ''}")
            if argv[1] == "/usr/local/bin/tailscale":
                assert out.splitlines()[0].startswith("1.102.3"), out
            else:
                assert out == {"amd64": "x86_64", "arm64": "aarch64"}[arch], out
    finally:
        subprocess.run(["podman", "rmi", ref], capture_output=True)
