"""Connector roles end to end: subnet router (`TS_ROUTES`) and exit node (`--advertise-exit-node`), with real
headscale (route approval), real tailscaled and our agent.

* Subnet router: the proxy advertises the backend LAN (10.98.0.0/24, fd98::/64); once approved, the client
  (--accept-routes) reaches the backend by its LAN addresses through the proxy. Restarted with the same state
  and `TS_ROUTES=""`, the proxy withdraws the routes and the client loses them (headscale 0.26 can go on
  serving them after such a restart, its known fault: the test says so as an expected failure, never when the
  proxy still announces them).
* Exit node: an `outside` namespace hangs off the proxy only (a veth, not the island bridge) with a server on
  documentation addresses (198.51.100.10, 2001:db8:1::10, one hop behind the proxy's 192.0.2.0/24 and
  2001:db8::/64 link) that exist nowhere else; the client uses the proxy as its exit node and reaches it.
  (A server ON the link would not do: tailscaled never forwards exit traffic to its own attached subnets.)
* Both on one device (what a Connector with spec.subnetRouter and spec.exitNode: true gets): the client uses
  the proxy as its exit node and reaches the backend LAN and the outside server through it, both families.
* TS_AUTH_ONCE: `--advertise-exit-node` added to TS_EXTRA_ARGS after the first login is applied on restart
  (through `tailscale set`; upstream passes no TS_EXTRA_ARGS to `set`), and stays applied over another restart.
"""
from __future__ import annotations

import json
from pathlib import Path

import labextras as lx
import pytest

from labtools.lab import wait_until

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(300)]

ROUTES_V4 = "10.98.0.0/24"
ROUTES_V6 = "fd98::/64"
EXIT_ROUTES = ("0.0.0.0/0", "::/0")
PORT = 8080
STARTED = "Startup complete, waiting for shutdown signal"


def state_dir(lab, name: str) -> str:
    """A state dir of the test's own, passed as TS_STATE_DIR, so a restarted agent keeps its node identity."""
    d = Path(lab.run_dir) / "connector" / name
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


def proxy_peer(lab) -> dict | None:
    """The proxy as the client sees it."""
    for p in (lab.status("client").get("Peer") or {}).values():
        if p.get("HostName") == "proxy":
            return p
    return None


def client_routes(lab) -> set[str]:
    """The proxy's routes the client actually uses (PrimaryRoutes: approved and advertised)."""
    p = proxy_peer(lab)
    return set((p or {}).get("PrimaryRoutes") or ())


def hs_routes(lab) -> str:
    """headscale's record of the proxy's routes: what the node announces, what is approved, what headscale serves
    to the other nodes (its primary routes)."""
    n = lab.hs_node("proxy") or {}
    return (f"announced {n.get('available_routes') or []}, approved {n.get('approved_routes') or []}, "
            f"served {n.get('subnet_routes') or []}")


def wait_client_routes(lab, want: set[str], what: str) -> None:
    """Wait until the client sees the proxy online and uses exactly ``want`` of its routes (online: an offline
    router's routes are left out whatever it announces, so "none" while it reconnects would prove nothing). A
    timeout names the routes the client still uses and headscale's record of them: a proxy that still announces
    a route is the agent's fault, a route headscale serves that the proxy no longer announces is the control
    server's."""
    def used() -> bool:
        p = proxy_peer(lab)
        return bool(p and p.get("Online") and set(p.get("PrimaryRoutes") or ()) == want)
    try:
        wait_until(used, 30, 0.3, what)
    except TimeoutError as e:
        raise AssertionError(f"{e}: the client uses {sorted(client_routes(lab))}; headscale: {hs_routes(lab)}") \
            from None


def proxy_prefs(lab) -> dict:
    return json.loads(lab.ts("proxy", "debug", "prefs").stdout)


def advertised(lab) -> set[str]:
    return set(proxy_prefs(lab).get("AdvertiseRoutes") or ())


def start_and_wait(start_agent, env: dict):
    agent = start_agent(env)
    agent.wait_for_log(STARTED, timeout=90)
    return agent


def forwarding(lab) -> tuple[str, str]:
    out = lab.exec("proxy", ["cat", "/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/ipv6/conf/all/forwarding"],
                   check=True).stdout.split()
    return out[0], out[1]


# ------------------------------------------------------------------------------------------------ subnet router

def test_subnet_router_routes_then_withdraws(lab, lab_backend, start_agent):
    routes = [ROUTES_V4] + ([ROUTES_V6] if lab.backend_ipv6 else [])
    sd = state_dir(lab, "subnet")
    agent = start_and_wait(start_agent, {"TS_ROUTES": ",".join(routes), "TS_STATE_DIR": sd})
    assert advertised(lab) == set(routes)
    fwd = forwarding(lab)
    assert fwd[0] == "1" and (fwd[1] == "1" or not lab.backend_ipv6), f"IP forwarding (v4, v6) is {fwd}"
    lab.approve_routes("proxy", routes)
    wait_client_routes(lab, set(routes), "client accepting the proxy's routes")

    urls = {4: lab.url(lab.backend_ipv4, PORT, "/?subnet4")}
    if lab.backend_ipv6:
        urls[6] = lab.url(lab.backend_ipv6, PORT, "/?subnet6")
    for url in urls.values():
        assert lab_backend.marker in lab.wait_curl("client", url, lab_backend.marker, timeout=45)

    # Restart with the same node identity and TS_ROUTES="" (set but empty): the routes are withdrawn.
    ips = agent.tailnet_ips()
    assert agent.stop() == 0
    assert lab.wait_ns_empty("proxy", 15) == []
    again = start_and_wait(start_agent, {"TS_ROUTES": "", "TS_STATE_DIR": sd})
    assert again.tailnet_ips() == ips, "the restart with the same state made a new node"
    assert advertised(lab) == set(), proxy_prefs(lab).get("AdvertiseRoutes")
    wait_until(lambda: not (lab.hs_node("proxy") or {}).get("available_routes"), 30, 0.3,
               "headscale seeing the routes withdrawn")
    try:
        wait_client_routes(lab, set(), "client dropping the withdrawn routes")
    except AssertionError as e:
        # headscale 0.26 sets a (re)connecting node's primary routes from the node as stored when its request
        # arrived: when tailscaled, started with the old prefs, logs in and the agent's `tailscale up` replaces
        # them at once, it can go on serving the routes the proxy no longer announces (docs/install-headscale.md).
        # The proxy did its part (announces nothing, asserted above); a proxy still announcing them fails here.
        n = lab.hs_node("proxy") or {}
        if lab.hs_version.startswith("v0.26.") and not n.get("available_routes") and n.get("subnet_routes"):
            pytest.xfail(f"headscale 0.26 serves routes the proxy no longer announces: {e}")
        raise
    for url in urls.values():
        cp = lab.curl("client", url, 3)
        assert lab_backend.marker not in cp.stdout, f"{url} still reachable through withdrawn routes"


# ------------------------------------------------------------------------------------------------ exit node

@pytest.fixture(scope="module")
def outside(lab):
    """`outside` namespace behind the proxy with an HTTP server on 198.51.100.10 / [2001:db8:1::10]:8080."""
    o = lx.add_outside_namespace(lab, "outside")
    srv = lab.start_http_server("outside", (o.v4, o.v6), PORT, f"outside-ok-{lab.prefix}")
    yield o, srv
    srv.proc.terminate()
    srv.proc.wait(10)
    lx.remove_namespace(lab, "outside")


@pytest.fixture
def client_exit_node(lab):
    """Sets the client's exit node; always unset afterwards (the client is shared by the whole session)."""
    def use(ip: str) -> None:
        wait_until(lambda: (proxy_peer(lab) or {}).get("ExitNodeOption"), 30, 0.3,
                   "the proxy offered to the client as an exit node")
        lab.ts("client", "set", f"--exit-node={ip}")
    yield use
    lab.ts("client", "set", "--exit-node=", check=False)


def check_outside(lab, o, srv, tag: str, proxy_ips: tuple[str | None, str | None]) -> None:
    """The client reaches the outside server through the proxy (nothing else links the two)."""
    for version, addr in ((4, o.v4), (6, o.v6)):
        url = lab.url(addr, PORT, f"/?{tag}{version}")
        body = lab.wait_curl("client", url, srv.marker, timeout=45)
        assert body.startswith(srv.marker)


def test_exit_node_with_auth_once_survives_restarts(lab, outside, start_agent, client_exit_node):
    o, srv = outside
    sd = state_dir(lab, "exit")
    base = {"TS_AUTH_ONCE": "true", "TS_STATE_DIR": sd}
    # Before: nothing routes the client to the documentation prefixes.
    assert lab.curl("client", lab.url(o.v4, PORT, "/?before"), 2).returncode != 0

    # First boot logs in without the flag; the node advertises nothing.
    first = start_and_wait(start_agent, {**base, "TS_EXTRA_ARGS": f"--login-server={lab.login_server}"})
    ips = first.tailnet_ips()
    assert not advertised(lab) & set(EXIT_ROUTES)
    assert first.stop() == 0
    assert lab.wait_ns_empty("proxy", 15) == []

    # Restart with --advertise-exit-node added: no new login (auth once), but the flag is applied by `set`.
    env = {**base, "TS_EXTRA_ARGS": f"--login-server={lab.login_server} --advertise-exit-node"}
    second = start_and_wait(start_agent, env)
    log = second.log_text()
    running = [ln for ln in log.splitlines() if ln.startswith("boot:") and "Running tailscale" in ln]
    assert " up " not in "\n".join(running), \
        "TS_AUTH_ONCE ran `tailscale up` again on an already logged-in node"
    assert second.tailnet_ips() == ips, "the restart made a new node"
    assert set(EXIT_ROUTES) <= advertised(lab), proxy_prefs(lab).get("AdvertiseRoutes")
    # An exit node forwards both families, like a subnet router does for its routes.
    assert forwarding(lab) == ("1", "1"), \
        f"IP forwarding (v4, v6) is {forwarding(lab)} in the proxy: the agent did not enable it for " \
        "--advertise-exit-node"
    lab.approve_routes("proxy", EXIT_ROUTES)
    client_exit_node(ips[0])
    check_outside(lab, o, srv, "exit-a", ips)
    # The outside server saw the proxy's address on that link (tailscaled's SNAT for exit traffic), so the
    # requests did leave through the proxy.
    seen = {r["peer"] for r in lab.http_peer_log(srv) if r["path"].startswith("/?exit-a")}
    assert seen and seen <= {o.link_v4[0], o.link_v6[0]}, seen

    # Another restart with the same settings: still an exit node, and the client's traffic flows again.
    assert second.stop() == 0
    assert lab.wait_ns_empty("proxy", 15) == []
    third = start_and_wait(start_agent, env)
    assert third.tailnet_ips() == ips
    assert set(EXIT_ROUTES) <= advertised(lab)
    check_outside(lab, o, srv, "exit-b", ips)


# ------------------------------------------------------------------------------------ subnet router + exit node

def test_subnet_router_that_is_also_an_exit_node(lab, lab_backend, outside, start_agent, client_exit_node):
    """The measurement behind the Connector that is both (kinds/connector.py): one real tailscaled advertising
    the backend LAN and the default routes (what the controller writes into a Connector proxy's config for
    spec.subnetRouter plus spec.exitNode: true), a client that uses it as its exit node and accepts its routes:
    does the client reach the subnet AND the outside through it? Printed either way, then asserted."""
    o, srv = outside
    routes = [ROUTES_V4] + ([ROUTES_V6] if lab.backend_ipv6 else [])
    sd = state_dir(lab, "both")
    agent = start_and_wait(start_agent, {"TS_ROUTES": ",".join([*routes, *EXIT_ROUTES]), "TS_STATE_DIR": sd})
    assert set(routes) | set(EXIT_ROUTES) <= advertised(lab)
    lab.approve_routes("proxy", [*routes, *EXIT_ROUTES])
    wait_until(lambda: set(routes) <= client_routes(lab), 30, 0.3, "the client accepting the subnet routes")
    ips = agent.tailnet_ips()
    client_exit_node(ips[0])
    targets = [(f"subnet v{v}", addr, f"/?both-subnet{v}", lab_backend.marker)
               for v, addr in ((4, lab.backend_ipv4), (6, lab.backend_ipv6)) if addr]
    targets += [(f"exit v{v}", addr, f"/?both-exit{v}", srv.marker) for v, addr in ((4, o.v4), (6, o.v6))]
    results = {}
    for what, addr, path, marker in targets:
        try:
            lab.wait_curl("client", lab.url(addr, PORT, path), marker, timeout=45)
            results[what] = "reached"
        except Exception as e:     # measured: every target is tried and reported before the assertion
            results[what] = f"NOT reached: {str(e)[-200:]}"
    print(f"subnet router + exit node on one tailscaled: {json.dumps(results, indent=1)}")
    assert all(v == "reached" for v in results.values()), results
    seen = {r["peer"] for r in lab.http_peer_log(srv) if r["path"].startswith("/?both-exit")}
    assert seen and seen <= {o.link_v4[0], o.link_v6[0]}, seen       # left through the proxy
    assert agent.stop() == 0
    assert lab.wait_ns_empty("proxy", 15) == []
