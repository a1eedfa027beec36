"""Demo: a proxy Pod's agent exposing a backend to the tailnet, in an island of network namespaces.

    sudo .venv/bin/python -m labtools.demo [--agent python|upstream] [--firewall nftables|iptables] [--once]
                                           [--image [IMAGE]] [--kube | --controller [--https] | --proxygroup
                                            | --apiserver-proxy | --dns | --gitops]

Builds the lab (headscale, a `client` tailscaled node, an HTTP backend), starts the agent in the `proxy`
namespace with TS_DEST_IP=<backend IPv4>[,<backend IPv6>] (--dest; dual-stack by default for our agent), prints
the proxy's tailnet IPs and the result of curl from the client through the proxy (IPv4, and IPv6 when the
destination has an IPv6 address), then waits for Ctrl-C (or exits at once
with --once) and tears everything down. Exit status: 0 if every curl that was expected to work worked.
--kube (labtools.kubedemo) and --controller (labtools.controllerdemo) run the same story in a real Kubernetes;
--controller --https serves an Ingress over HTTPS with a certificate cert-manager issues (labtools.controllerdemo);
--proxygroup (labtools.pgdemo) egresses to the tailnet through a ProxyGroup of two and deletes one replica.
--apiserver-proxy (labtools.apiproxydemo) shows kubectl from the tailnet client through the API server proxy.
--dns (labtools.dnsdemo) shows a tailnet name resolving in a Pod through a DNSConfig.
--gitops (labtools.gitopsdemo): `make release` into the lab's registry, Flux installs the controller from it.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time

from labtools import image as labimage
from labtools.lab import Lab, LabError, ensure_binaries

STARTUP = "Startup complete, waiting for shutdown signal"


def _say(msg: str) -> None:
    print(msg, flush=True)


def _curl_through(lab: Lab, ip: str, marker: str, tag: str, timeout: float) -> tuple[bool, str, float]:
    t0 = time.monotonic()
    path = f"/demo-{tag}"
    try:
        body = lab.wait_curl("client", lab.url(ip, 8080, path), marker, timeout=timeout, per_try=2)
        peers = [r["peer"] for r in lab.http_peer_log("backend", 8080) if r["path"] == path]
        return True, body.strip().replace("\n", " | ") + f"  (backend saw peer {peers[-1] if peers else '?'})", \
            time.monotonic() - t0
    except TimeoutError as e:
        return False, str(e), time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m labtools.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--agent", choices=("python", "upstream"), default="python")
    ap.add_argument("--firewall", choices=("nftables", "iptables"), default="nftables")
    ap.add_argument("--once", action="store_true", help="exit after printing instead of waiting for Ctrl-C")
    ap.add_argument("--dest", choices=("v4", "dual"), default=None,
                    help="TS_DEST_IP: the backend's IPv4 only, or its IPv4 and IPv6 (our agent's dual-stack form; "
                         "upstream takes one address). Default: dual for --agent python, v4 for upstream")
    ap.add_argument("--timeout", type=float, default=90, help="seconds to wait for the agent to be Running")
    ap.add_argument("--image", nargs="?", const=labimage.IMAGE, default=None,
                    help="run our agent from this container image (default: LAB_PROXY_IMAGE, else "
                         "localhost/containerboot-py:latest; built by `make image`) with podman in the proxy namespace")
    ap.add_argument("--diagnostics", action="store_true", help="print lab diagnostics at the end")
    ap.add_argument("--kube", action="store_true", help="the agent as a StatefulSet Pod in a real Kubernetes "
                    "exposing a backend Deployment's ClusterIP (labtools.kubedemo)")
    ap.add_argument("--dns", action="store_true", help="a DNSConfig in a real Kubernetes with CoreDNS: a Pod "
                    "resolves a tailnet node's MagicDNS name and fetches its page (labtools.dnsdemo)")
    ap.add_argument("--apiserver-proxy", action="store_true", help="the controller installed with helm and "
                    "apiServerProxy.mode=auth: kubectl from the tailnet client through it (labtools.apiproxydemo)")
    ap.add_argument("--recorder", action="store_true", help="with --apiserver-proxy: a grant that enforces session "
                    "recording, a Recorder object run by the controller; a recorded kubectl exec -it, then one refused "
                    "with the Recorder scaled to 0 (labtools.apiproxydemo)")
    ap.add_argument("--https", action="store_true", help="with --controller: an Ingress with a certificate "
                    "cert-manager issues, curl --cacert over HTTPS from the tailnet client (docs/https.md)")
    ap.add_argument("--controller", action="store_true", help="the companion controller installed from deploy/ "
                    "in a real Kubernetes exposes an annotated Service (labtools.controllerdemo)")
    ap.add_argument("--proxygroup", action="store_true", help="a client Pod egresses to a tailnet node through "
                    "a ProxyGroup of two while one replica is deleted (labtools.pgdemo)")
    ap.add_argument("--gitops", action="store_true", help="`make release` into the lab's registry, then Flux's "
                    "source-controller and helm-controller install the controller from it (OCIRepository, "
                    "HelmRelease) and an exposed Service is reached from the tailnet (labtools.gitopsdemo)")
    a = ap.parse_args(argv)
    if a.image and a.agent != "python":
        ap.error("--image runs our agent; it cannot be combined with --agent upstream")
    if a.image:
        from labtools.image import unavailable
        if (why := unavailable(a.image)):
            _say(f"cannot run the image: {why}")
            return 2
    if a.dest is None:
        a.dest = "dual" if a.agent == "python" else "v4"

    # SIGTERM behaves like Ctrl-C: unwind through the context manager, which tears the lab down.
    def _term(*_: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _term)
    # Ctrl-C must unwind even if we were started with SIGINT ignored (e.g. as a background job of a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    if a.https and not a.controller:
        ap.error("--https goes with --controller")
    if a.recorder and not a.apiserver_proxy:
        ap.error("--recorder goes with --apiserver-proxy")
    if a.apiserver_proxy:
        from labtools import apiproxydemo
        try:
            return apiproxydemo.run(a.firewall, a.once, recorder=a.recorder)
        except KeyboardInterrupt:
            return 130
    if a.gitops:
        from labtools import gitopsdemo
        try:
            return gitopsdemo.run(a.firewall, a.once)
        except KeyboardInterrupt:
            _say("\ninterrupted; lab and cluster torn down")
            return 0
        except LabError as e:
            _say(f"lab error: {e}")
            return 2
    if a.kube or a.controller or a.proxygroup or a.dns:
        from labtools import controllerdemo, dnsdemo, kubedemo, pgdemo
        try:
            if a.proxygroup:
                return pgdemo.run(a.firewall, a.once)
            if a.dns:
                return dnsdemo.run(a.firewall, a.once)
            if a.controller:
                return controllerdemo.run(a.firewall, a.once, https=a.https)
            return kubedemo.run(a.firewall, a.once)
        except KeyboardInterrupt:
            _say("\ninterrupted; lab and cluster torn down")
            return 0
        except LabError as e:
            _say(f"lab error: {e}")
            return 2

    ok = True
    t_all = time.monotonic()
    try:
        t0 = time.monotonic()
        bin_dir = ensure_binaries(upstream=a.agent == "upstream")
        _say(f"binaries: {bin_dir} ({time.monotonic() - t0:.1f}s)")
        t0 = time.monotonic()
        with Lab.create(bin_dir=bin_dir, firewall_mode=a.firewall) as lab:
            _say(f"lab {lab.prefix} up in {time.monotonic() - t0:.1f}s "
                 f"(topology {lab.timings['topology']:.1f}s, headscale {lab.timings['headscale']:.1f}s, "
                 f"client node {lab.timings['client_node']:.1f}s); run dir {lab.run_dir}")
            c4, c6 = lab.tailnet_ips("client")
            _say(f"client tailnet IPs: {c4} {c6}")
            marker = f"backend-ok-{lab.prefix}"
            lab.start_http_server("backend", None, 8080, marker)
            _say(f"backend HTTP server on {lab.backend_ipv4}:8080 and [{lab.backend_ipv6}]:8080")

            cmd = [str(bin_dir / "containerboot")] if a.agent == "upstream" else [sys.executable, "-m", "containerboot"]
            dest = lab.backend_ipv4 + (f",{lab.backend_ipv6}" if a.dest == "dual" and lab.backend_ipv6 else "")
            env = {"TS_DEST_IP": dest, "TS_DEBUG_FIREWALL_MODE": a.firewall}
            t0 = time.monotonic()
            agent = lab.start_agent(env, cmd, image=a.image)
            image = f", image {a.image}" if a.image else ""
            _say(f"agent ({a.agent}{image}, firewall {a.firewall}, TS_DEST_IP={dest}) started: pid {agent.pid}, "
                 f"log {agent.log_path}")
            try:
                agent.wait_running(a.timeout)
                t_run = time.monotonic() - t0
                p4, p6 = agent.tailnet_ips()
                _say(f"proxy is Running after {t_run:.1f}s; tailnet IPs: {p4} {p6}")
                try:
                    agent.wait_for_log(STARTUP, 30)
                    _say(f"agent logged '{STARTUP}' after {time.monotonic() - t0:.1f}s")
                except (TimeoutError, LabError) as e:
                    _say(f"agent did not log '{STARTUP}': {e}")
                    ok = False
                lab.wait_peer("client", agent.hostname, 30)
                # IPv6 through the proxy needs an IPv6 destination (tailnet v6 is DNATed within its family)
                families = [("IPv4", p4)] + ([("IPv6", p6)] if "," in dest and p6 else [])
                for fam, ip in families:
                    good, text, dt = _curl_through(lab, ip, marker, fam.lower(), 30 if fam == "IPv4" else 15)
                    ok &= good
                    _say(f"curl client -> {lab.url(ip, 8080)} ({fam}): {'OK' if good else 'FAILED'} "
                         f"in {dt:.1f}s: {text}")
            except (TimeoutError, LabError) as e:
                ok = False
                _say(f"agent did not come up: {e}\n--- agent log tail ---\n{agent.log_text()[-4000:]}")
            if a.diagnostics or not ok:
                _say(lab.dump_diagnostics())
            if not a.once:
                _say("lab is up; press Ctrl-C to tear it down")
                while agent.running():
                    time.sleep(0.5)
                _say(f"agent exited by itself (rc={agent.returncode})")
            t0 = time.monotonic()
            rc = agent.stop()
            left = lab.wait_ns_empty("proxy", 15)
            _say(f"agent stopped (rc={rc}) in {time.monotonic() - t0:.1f}s; processes left in proxy ns: {left}")
            ok &= not left
    except KeyboardInterrupt:
        _say("\ninterrupted; lab torn down")
    except LabError as e:
        _say(f"lab error: {e}")
        return 2
    _say(f"done in {time.monotonic() - t_all:.1f}s; everything torn down")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
