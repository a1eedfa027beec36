"""`tailscale-controller` / `python -m controller`: load the settings, build the provider, win the leader
Lease (`controller.leader`), then run kopf and the work queue until stopped or the Lease is lost."""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Awaitable, Callable

from tscommon.redact import redact

from .config import ConfigError, ControllerConfig, load
from .resources import Resource


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


def polled(cfg: ControllerConfig) -> dict[str | tuple[str, str, str], float]:
    """The objects the controller reads but does not watch, and how often they are read for all passes together:
    the proxies' namespace (its Pod Security level: a refused parent is re-checked every POD_SECURITY_RECHECK, and
    sees a new label within that and this), the CA ConfigMap and the static key's Secret. (The ServiceMonitor CRD
    is watched: controller.watchcache.WATCHED.)"""
    from .kubeapi import CONFIGMAPS, NAMESPACES, SECRETS
    out: dict[str | tuple[str, str, str], float] = {NAMESPACES.plural: NAMESPACE_POLL}
    if cfg.proxy_ca_configmap:
        out[(CONFIGMAPS.plural, cfg.namespace, cfg.proxy_ca_configmap)] = NAMESPACE_POLL
    if cfg.provider == "static":
        out[(SECRETS.plural, cfg.namespace, cfg.static_key_secret)] = NAMESPACE_POLL
    return out


async def serve_health(addr: str, role: Callable[[], str]) -> asyncio.AbstractServer:
    """`GET /healthz` → 200 and the replica's role, in both roles (a standby runs no kopf, whose liveness
    endpoint would be missing, and the kubelet would restart every standby)."""
    host, _, port = addr.rpartition(":")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            ok = line.split(b" ")[1:2] == [b"/healthz"]
            body = (role() if ok else "not found").encode() + b"\n"
            writer.write(b"HTTP/1.1 %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                         % (b"200 OK" if ok else b"404 Not Found", len(body)) + body)
            await writer.drain()
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()
    return await asyncio.start_server(handle, host.strip("[]") or None, int(port))


async def detect_control_plane(provider) -> None:
    """The control plane's version and what it cannot do, logged once by the provider (headscale's); one that
    cannot be reached now is read at its first call instead."""
    detect = getattr(provider, "detect", None)
    if detect is None:
        return
    from .providers import ProviderError
    try:
        await detect()
    except ProviderError as e:
        logging.getLogger("controller").warning("%s; its version is read again at the first call", e)


def served_crds() -> tuple[Resource, ...]:
    """The project's CRDs among the kinds the controller watches (Connector, DNSConfig, ProxyClass, ProxyGroup,
    Recorder): each must be installed before kopf starts (controller.crdcheck)."""
    from .crdcheck import GROUP
    from .watchcache import WATCHED
    return tuple(w.res for w in WATCHED if w.res.group == GROUP)


async def unless_stopped(step: Awaitable[object], stop: asyncio.Event) -> bool:
    """Run a start-up step unless the stop comes first: True once it is done (its error raised), False when the
    stop came first (the step cancelled)."""
    task = asyncio.ensure_future(step)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if not task.done():
        task.cancel()
        return False
    task.result()
    return True


#: How often the objects that are not watched (the namespace's Pod Security level, the CA ConfigMap, the static
#: key) are read again, once for every pass that needs them (seconds).
NAMESPACE_POLL = 20.0

#: How often the fault counts held by the log folding are checked for a window that has passed (seconds).
FLUSH_EVERY = 5.0


async def run(cfg: ControllerConfig) -> int:
    import kopf

    from . import crdcheck, kopfready, relist
    from .handlers import State, kopf_login, registries, settings
    from .kubeapi import Kube
    from .leader import LeaderElector, LeaseUnrenewed, LostLeadership
    from .model import PROXYGROUP
    from .queue import WorkQueue
    from .reconcile import Reconciler
    from .replicaprober import ReplicaProber
    from .watchcache import WATCHED, CachedKube, WatchCache

    # kopf's default identity asks getpass for the user name, which fails for a UID without a passwd entry
    # (the image runs as 65532: "KeyError: 'getpwuid(): uid not found: 65532'", a crash loop in a real Pod).
    # The suffix makes two processes on one host (or a restarted container) distinct candidates.
    identity = f"tailscale-controller@{socket.gethostname()}-{secrets.token_hex(3)}"
    elector = LeaderElector(Kube.in_cluster(), cfg.namespace, identity, pod_name=cfg.pod_name)
    api = Kube.in_cluster()
    api.write_guard = elector.is_leader
    # The passes read what kopf's watches hold (controller.watchcache); the few objects nobody watches are
    # polled once for all of them.
    # kopf runs each object's handlers once it is indexed, without waiting for the whole first listing; the cache
    # counts the listings to know when its indexes are filled (controller.kopfready)
    cache = WatchCache(cfg.namespace, count_listings=True)
    kopfready.install()
    # what a watch's fresh listing no longer returns leaves the cache (controller.relist)
    relist.install((w.res for w in WATCHED), cache)
    kube = CachedKube(api, cache, polled(cfg))
    provider = make_provider(cfg, kube)
    # The leader probes the ProxyGroup replicas' health over the Pod network: one that stops answering leaves
    # the egress EndpointSlices within seconds (controller/replicahealth.py). Its loop starts with the Lease.
    prober = ReplicaProber(lambda group: state.queue.poke((PROXYGROUP, "", group)))
    rec = Reconciler(kube, provider, cfg, prober=prober)

    async def work(key) -> float | None:
        if not elector.is_leader():
            # Fenced (the Lease could not be renewed): the key waits for the renewal (`retry_now` then), or for
            # the stop if another replica took the Lease (the next leader re-runs it).
            return 10.0
        await cache.wait_synced()       # a pass reads what the watches have listed, not an empty cache
        return await rec.reconcile(*key)
    state = State(cfg, rec, WorkQueue(work), cache=cache)
    rec.poke = state.queue.poke
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signals() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    on_signals()
    health = await serve_health(os.environ.get("CONTROLLER_HEALTH_ADDR", "0.0.0.0:8080"),
                                lambda: "leader" if elector.is_leader() else "standby")

    async def flush_fault_counts() -> None:
        """The failures counted but not logged, said once their window has passed with no line to carry them."""
        from .logfold import flush_all
        while True:
            await asyncio.sleep(FLUSH_EVERY)
            flush_all()
            state.queue.fault_log.flush()
    flusher = asyncio.ensure_future(flush_fault_counts())
    log = logging.getLogger("controller")
    lost: list[str] = []
    removed_crds: list[str] = []
    try:
        # kopf resolves the kinds it serves once, at its start (its scanning of CRDs is off): each of the
        # project's CRDs must be installed by then (controller.crdcheck); a replica without them exits, naming them
        if not await unless_stopped(crdcheck.wait_installed(served_crds(), api.served), stop):
            return 0
        # standby: only the Lease is read, nothing is watched or written
        if not await unless_stopped(elector.acquire(), stop):
            return 0
        probing = asyncio.ensure_future(prober.run())
        await detect_control_plane(provider)

        def removed(message: str) -> None:
            log.error("controller: %s", message)
            removed_crds.append(message)
            stop.set()
        crdcheck.stop_on_removal(served_crds(), removed)
        parents, children = registries(state, functools.partial(kopf_login, api.url, api.token, api.ca_file,
                                                                cfg.namespace))
        # One stop flag for both operators: each kopf operator installs its own SIGTERM handler, and the
        # second would replace the first's (that operator then never stops). Ours is installed again once
        # both are up. kopf's peering is off (standalone): the Lease decides who runs (docs/controller.md).
        ready = (asyncio.Event(), asyncio.Event())

        async def signals() -> None:
            await asyncio.gather(*(r.wait() for r in ready))
            on_signals()

        async def keep_lease() -> None:
            try:
                while True:
                    try:
                        await elector.hold()
                    except LeaseUnrenewed as e:
                        # The API server does not answer: nothing is written (fenced) until the Lease is renewed;
                        # the watches and the queue stay, so nothing is lost or re-listed when it answers again.
                        t0 = loop.time()
                        log.error("leader election: %s; writes stop until it is renewed (the watches and the work "
                                  "queue are kept)", e)
                        await elector.regain()
                        log.info("leader election: Lease renewed after %.0fs without; leading again, retrying the "
                                 "waiting passes now", loop.time() - t0)
                        state.queue.retry_now()
            except LostLeadership as e:
                lost.append(str(e))
                log.error("leader election: lost leadership (%s); stopping all work", e)
                await state.queue.aclose()      # in-flight passes stop now, before kopf winds down
                stop.set()

        async def until_stopped() -> None:
            """A clean stop hands over at once: renewals end, writes are fenced, passes in flight are cancelled,
            the Lease is released, and only then does kopf wind down (it takes seconds and writes nothing)."""
            await stop.wait()
            holder.cancel()
            elector.fence()
            await state.queue.aclose()
            if not lost:
                await elector.release()
        holder = asyncio.ensure_future(keep_lease())
        try:
            await asyncio.gather(
                kopf.operator(registry=parents, settings=settings(False), clusterwide=True, standalone=True,
                              identity=identity,  # type: ignore[arg-type]  # kopf's Identity type is private
                              stop_flag=stop, ready_flag=ready[0]),
                kopf.operator(registry=children, settings=settings(True), namespaces=[cfg.namespace],
                              standalone=True, identity=identity,  # type: ignore[arg-type]  # as above
                              stop_flag=stop, ready_flag=ready[1]),
                signals(), until_stopped())
        finally:
            holder.cancel()
            probing.cancel()
    finally:
        flusher.cancel()
        await state.queue.aclose()
        if not lost:
            await elector.release()
        health.close()
        await provider.aclose()
        await api.aclose()
        await elector.kube.aclose()
    # a replica that lost the Lease exits non-zero: the kubelet restarts it as a standby
    if removed_crds:
        raise crdcheck.CRDsMissing(removed_crds[0])
    return 1 if lost else 0


def apply_log_level(level: str) -> None:
    """OPERATOR_LOGGING: debug lowers the controller's own loggers to DEBUG; dev lowers kopf's too. The HTTP
    client's loggers stay at WARNING at every level: their debug lines would carry request details."""
    if level in ("debug", "dev"):
        logging.getLogger("controller").setLevel(logging.DEBUG)
    if level == "dev":
        logging.getLogger().setLevel(logging.DEBUG)
        logging.getLogger("kopf").setLevel(logging.DEBUG)
        logging.getLogger("kopf.objects").setLevel(logging.DEBUG)
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # kopf logs every handler call at INFO; the reconciler logs what users need.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # kopf logs each failed API request it retries (every watch restart against a flaky API server, a line per
    # attempt per watch while the API server is gone): folded to one a minute per kind
    from .logfold import install
    install()
    try:
        resolv = open("/etc/resolv.conf", encoding="utf-8").read()
    except OSError:
        resolv = ""
    try:
        cfg = load(os.environ, resolv_conf=resolv)
    except ConfigError as e:
        print(f"tailscale-controller: {redact(str(e))}", file=sys.stderr)
        return 2
    apply_log_level(cfg.logging)
    logging.getLogger("controller").info(
        "controller: provider %s, proxies in namespace %s, image %s, login server %s", cfg.provider,
        cfg.namespace, cfg.proxy_image, cfg.server_url)
    from .crdcheck import CRDsMissing
    from .kubeapi import KubeError
    try:
        return asyncio.run(run(cfg))
    except (KubeError, CRDsMissing) as e:
        print(f"tailscale-controller: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
