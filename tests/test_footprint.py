"""What the agent loads for a configuration that does not need it (resident memory; bench/footprint has the
figures). Each check runs in a fresh interpreter, so that other tests' imports cannot hide a regression."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_an_l3_ingress_agent_loads_no_kubernetes_dns_watch_or_netlink_library():
    mods = loaded_after("from containerboot.settings import load\n"
                        "s = load({'TS_DEST_IP': '10.0.0.7', 'TS_USERSPACE': 'false'})\n"
                        "import containerboot.agent, containerboot.reconcile, netfilter.nft, netfilter.detect\n"
                        "from containerboot.agent import Agent\nAgent(s, {})")
    for heavy in ("httpx", "dns", "dns.asyncresolver", "watchdog", "pyroute2", "containerboot.kube"):
        assert heavy not in mods, heavy


def test_the_conntrack_clean_up_loads_pyroute2s_conntrack_only_and_the_rest_still_imports():
    mods = loaded_after("from netfilter.conntrack import conntrack_class\nC = conntrack_class()\n"
                        "assert C.__name__ == 'Conntrack'")
    assert "pyroute2.conntrack" in mods
    assert not {"pyroute2.ndb.main", "pyroute2.ipdb", "pyroute2.iwutil"} & mods
    # a later `from pyroute2 import X` (anywhere) gets the real package
    loaded_after("from netfilter.conntrack import conntrack_class\nconntrack_class()\n"
                 "from pyroute2 import IPRoute, Conntrack, config\nimport pyroute2\nassert pyroute2.IPRoute")


def test_the_agent_starts_asyncio_without_ssl_and_an_l3_ingress_never_loads_it():
    mods = loaded_after("import containerboot.__main__\nfrom containerboot.settings import load\n"
                        "s = load({'TS_DEST_IP': '10.0.0.7', 'TS_USERSPACE': 'false'})\n"
                        "import containerboot.agent, containerboot.reconcile, netfilter.nft, netfilter.detect\n"
                        "from containerboot.agent import Agent\nAgent(s, {})")
    assert "asyncio" in mods
    assert not {"ssl", "_ssl", "_hashlib", "certifi"} & mods


def test_asyncio_speaks_tls_once_something_imports_ssl_after_the_deferral(tmp_path):
    from tests.support.kubeapi import make_certs
    certs = make_certs(str(tmp_path), ["127.0.0.1"])
    code = f"""
import containerboot.__main__
from containerboot.deferssl import ssl_deferred
assert ssl_deferred()
import asyncio, ssl   # as httpx or the reachability probe would, later in the agent's life
assert not ssl_deferred()

async def main():
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain({certs.cert_path!r}, {certs.key_path!r})
    async def serve(reader, writer):
        writer.write(b"hello " + await reader.readline())
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    client_ctx = ssl.create_default_context(cafile={certs.ca_path!r})
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx)
    writer.write(b"tls\\n")
    print((await reader.read()).decode().strip())
    writer.close()
    server.close()

asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hello tls"


def test_the_conntrack_clean_up_in_a_child_leaves_pyroute2_out_of_the_agent_and_returns_its_count():
    out = subprocess.run([sys.executable, "-c", (
        "import sys\nimport netfilter.conntrack as ct\nfrom netfilter.model import RuleSet\n"
        "def flush(rules, previous):\n"
        "    ct.conntrack_class()   # what the real clean-up loads\n"
        "    return 3\n"
        "ct.flush_stale_conntrack = flush\n"
        "print(ct.PendingCleanup(RuleSet(), None).run_in_child())\n"
        "print('pyroute2.conntrack' in sys.modules)\n")],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "False"]
