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
