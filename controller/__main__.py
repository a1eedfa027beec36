"""`tailscale-controller` / `python -m controller`: load the settings, build the provider, run kopf."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys

from tscommon.redact import redact

from .config import ConfigError, ControllerConfig, load


def make_provider(cfg: ControllerConfig, kube):
    if cfg.provider == "headscale":
        from .providers.headscale import HeadscaleProvider
        return HeadscaleProvider(cfg.headscale_url, api_key_file=cfg.headscale_api_key_file, user=cfg.headscale_user)
    if cfg.provider == "tailscale":
        from .providers.tailscale import TailscaleProvider
        return TailscaleProvider(cfg.tailscale_api_url, tailnet=cfg.tailnet, client_id_file=cfg.oauth_client_id_file,
                                 client_secret_file=cfg.oauth_client_secret_file)
    from .kubeapi import SECRETS
    from .providers.static import StaticKeyProvider

    async def read() -> str | None:
        import base64
        s = await kube.get(SECRETS, cfg.static_key_secret, cfg.namespace)
        raw = ((s or {}).get("data") or {}).get("authkey")
        return base64.b64decode(raw).decode() if raw else None
    return StaticKeyProvider(read, cfg.static_key_secret)


async def run(cfg: ControllerConfig) -> None:
    import kopf

    from .handlers import State, registries, settings
    from .kubeapi import Kube
    from .queue import WorkQueue
    from .reconcile import Reconciler

    kube = Kube.in_cluster()
    provider = make_provider(cfg, kube)
    rec = Reconciler(kube, provider, cfg)

    async def work(key) -> float | None:
        return await rec.reconcile(*key)
    state = State(cfg, rec, WorkQueue(work))

    def login() -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=kube.url, token=kube.token(), ca_path=kube.ca_file or None,
                                   default_namespace=cfg.namespace)
    parents, children = registries(state, login)
    # One stop flag for both operators: each kopf operator installs its own SIGTERM handler, and the second
    # would replace the first's (that operator then never stops). Ours is installed once both are up.
    stop = asyncio.Event()
    ready = (asyncio.Event(), asyncio.Event())
    health = os.environ.get("CONTROLLER_HEALTH_ADDR", "0.0.0.0:8080")
    # kopf's default identity asks getpass for the user name, which fails for a UID without a passwd entry
    # (the image runs as 65532: "KeyError: 'getpwuid(): uid not found: 65532'", a crash loop in a real Pod)
    identity = f"tailscale-controller@{socket.gethostname()}"

    async def signals() -> None:
        await asyncio.gather(*(r.wait() for r in ready))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.gather(
            kopf.operator(registry=parents, settings=settings(False), clusterwide=True, standalone=True,
                          identity=identity, liveness_endpoint=f"http://{health}/healthz", stop_flag=stop,
                          ready_flag=ready[0]),
            kopf.operator(registry=children, settings=settings(True), namespaces=[cfg.namespace], standalone=True,
                          identity=identity, stop_flag=stop, ready_flag=ready[1]),
            signals())
    finally:
        await state.queue.aclose()
        await provider.aclose()
        await kube.aclose()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # kopf logs every handler call at INFO; the reconciler logs what users need.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        resolv = open("/etc/resolv.conf", encoding="utf-8").read()
    except OSError:
        resolv = ""
    try:
        cfg = load(os.environ, resolv_conf=resolv)
    except ConfigError as e:
        print(f"tailscale-controller: {redact(str(e))}", file=sys.stderr)
        return 2
    logging.getLogger("controller").info(
        "controller: provider %s, proxies in namespace %s, image %s, login server %s", cfg.provider,
        cfg.namespace, cfg.proxy_image, cfg.server_url)
    from .kubeapi import KubeError
    try:
        asyncio.run(run(cfg))
    except KubeError as e:
        print(f"tailscale-controller: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
