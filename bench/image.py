"""The proxy image: size and where the bytes go, boot inside the container vs outside, `make image` times.

Run as root: `python -m bench.image [--runs 5] [--firewall nftables] [--cold]`.

* size: the image's uncompressed size (podman's figure), its OCI archive, each layer, and `du` of the top
  directories inside it;
* boot: process start to "Startup complete" for the agent run directly (this venv, the regular tailscaled)
  and from the image (podman run in the same lab namespace), interleaved, one warm-up each, median of
  `--runs`; the ratio is inside/outside;
* build: warm `make image` (nothing changed), and with `--cold` a build from nothing: an empty podman storage
  and image cache in a temporary directory (the base made by mmdebstrap, the Python packages downloaded, the
  slim tailscaled built with a warm Go build cache, as after `make setup-bin`). The machine's own storage and
  caches are not touched.
No asserts: figures are for people to read.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import boot as _boot
from labtools import image as img
from labtools.lab import Lab, ensure_binaries

REPO = Path(__file__).resolve().parent.parent
TOP_DIRS = ("/usr/lib/python3.11", "/usr/lib/x86_64-linux-gnu", "/usr/bin", "/usr/sbin", "/usr/share",
            "/usr/local/bin", "/opt/venv", "/var", "/etc")


def _run(argv: list[str], env: dict | None = None, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env, check=True)


def build(env: dict | None = None, target: str = "image") -> tuple[float, str]:
    t0 = time.monotonic()
    cp = _run(["make", "-s", target], env=env)
    return time.monotonic() - t0, cp.stdout.strip().splitlines()[-1] if cp.stdout.strip() else ""


def cold_build() -> tuple[float, str]:
    """`make image` with an empty podman storage and image cache (a temporary directory, removed after)."""
    tmp = Path(tempfile.mkdtemp(prefix="cbpy-cold-"))
    try:
        conf = tmp / "storage.conf"
        conf.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{tmp}/graph"\nrunroot = "{tmp}/run"\n')
        bin_dir = Path(_run(["bash", "scripts/install-binaries.sh", "--print-dir"]).stdout.strip())
        cache = tmp / "cache"
        cold_bin = cache / "bin" / bin_dir.name
        cold_bin.mkdir(parents=True)
        for b in ("tailscaled", "tailscale", "containerboot", "headscale"):  # setup-bin's, not the image's
            os.symlink(bin_dir / b, cold_bin / b)
        env = {**os.environ, "CONTAINERS_STORAGE_CONF": str(conf), "CB_CACHE": str(cache)}
        took, line = build(env)
        subprocess.run(["podman", "rmi", "-a", "-f"], env=env, capture_output=True, timeout=300)
        return took, line
    finally:
        subprocess.run(["umount", "-R", str(tmp / "graph" / "overlay")], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def sizes(image: str) -> list[list[str]]:
    info = json.loads(_run(["podman", "image", "inspect", image]).stdout)[0]
    archive = Path(_run(["bash", "images/build.sh", "--print-archive"]).stdout.strip())
    print(f"image {image}: {info['Size'] / 1e6:.1f} MB uncompressed ({info['Size'] / 2**20:.1f} MiB); "
          f"OCI archive {archive.stat().st_size / 2**20:.1f} MiB")
    hist = json.loads(_run(["podman", "history", "--format", "json", image]).stdout)
    print("layers (bytes added, newest first):")
    layers = []
    for h in hist:
        if h.get("size", 0) > 0:
            what = (h.get("CreatedBy") or h.get("createdBy") or "").replace("/bin/sh -c ", "")[:90]
            print(f"  {h['size'] / 1e6:7.1f} MB  {what}")
            if h["size"] >= 1e6:
                layers.append(f"{h['size'] / 1e6:.1f} MB `{what[:60]}`")
    rt, ul = img.host_args()
    du = _run(["podman", *rt, "run", "--rm", "--network", "none", *ul, "--entrypoint", "/bin/sh", image, "-c",
               f"du -sk {' '.join(TOP_DIRS)}; du -sk /usr/local/bin/* /opt/venv/lib/python3.11/site-packages/* "
               "| sort -rn | head -6"]).stdout
    print("where the bytes go (du inside the image):")
    for line in du.splitlines():
        kb, path = line.split(maxsplit=1)
        print(f"  {int(kb) / 1024:7.1f} MiB  {path}")
    return [["image size, uncompressed (podman)", f"{info['Size'] / 1e6:.0f} MB ({info['Size'] / 2**20:.1f} MiB); "
             f"OCI archive {archive.stat().st_size / 2**20:.1f} MiB",
             "under 150 MB: " + ("met" if info["Size"] < 150e6 else "not met")],
            ["where the bytes go (layers of 1 MB or more, newest first)", "; ".join(layers), ""]]


def boot_once(lab: Lab, env: dict, marker: str, image: str | None) -> float:
    return _boot.boot_once(lab, None, env, marker, image=image)


def boot(image: str, runs: int, firewall: str) -> list[str]:
    bin_dir = ensure_binaries()
    kinds = {"outside": None, "inside": image}
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    with Lab.create(bin_dir=bin_dir) as lab:
        srv = lab.start_http_server("backend", None, 8080, f"bench-{lab.prefix}")
        env = {"TS_DEST_IP": lab.backend_ipv4, "TS_DEBUG_FIREWALL_MODE": firewall}
        for _name, im in kinds.items():
            boot_once(lab, env, srv.marker, im)
        for i in range(runs):
            for name, im in kinds.items():
                t = boot_once(lab, env, srv.marker, im)
                samples[name].append(t)
                print(f"run {i + 1}: {name:8s} {t:6.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"boot to 'Startup complete' ({firewall}, median of {runs}): outside {med['outside']:.2f} s, "
          f"inside the container {med['inside']:.2f} s, ratio inside/outside {med['inside'] / med['outside']:.3f}")
    ratio = med["inside"] / med["outside"]
    return [f'boot to "Startup complete", outside vs inside the container (same lab, {firewall}, median of {runs}, '
            "interleaved)", f"{med['outside']:.2f} s vs {med['inside']:.2f} s: ratio {ratio:.3f}",
            "≤ 1.05: " + ("met" if ratio <= 1.05 else "not met")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--firewall", default="nftables", choices=("nftables", "iptables"))
    p.add_argument("--cold", action="store_true", help="also time a build from an empty storage (minutes)")
    p.add_argument("--no-boot", action="store_true")
    p.add_argument("--record", action="store_true", help="write bench/results/image.json (docs/benchmarks.md)")
    p.add_argument("--recorded", default="", help="which run and machine, for the results file")
    a = p.parse_args(argv)
    iid = Path(tempfile.mkstemp(prefix="cbpy-iid-")[1])
    try:
        build()                                           # make sure it is built and current
        took, line = build()
        print(f"warm make image (nothing changed): {took:.1f} s  [{line}]")
        _run(["bash", "images/build.sh", "--iidfile", str(iid)])
        image = iid.read_text().strip()
    finally:
        iid.unlink(missing_ok=True)
    warm = took
    cold = None
    if a.cold:
        cold, line = cold_build()
        print(f"cold make image (empty storage and image cache): {cold:.1f} s  [{line}]")
    rows = sizes(image)
    if not a.no_boot:
        rows.append(boot(image, a.runs, a.firewall))
    rows.append(["warm `make image` (nothing changed)", f"{warm:.1f} s", "under 10 s: " + ("met" if warm < 10 else
                                                                                          "not met")])
    if cold is not None:
        rows.append(["cold `make image` (empty podman storage and image cache; mmdebstrap base, PyPI downloads, the "
                     "image's tailscaled compiled with a warm Go build cache as after `make setup-bin`)",
                     f"{cold:.0f} s", ""])
    from bench.results import Results, Table, machine, record
    if a.no_boot or not a.cold:
        print("figures not recorded: the results file holds every row (run without --no-boot and with --cold)")
    else:
        record(Results("image", "python -m bench.image --cold", a.recorded or f"{machine()}; the offline build",
                       {"main": Table.of(["figure", "measured", "goal"], rows)}), a.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
