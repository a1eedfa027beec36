"""tscommon.pgcontract: what the controller writes into a ProxyGroup's ConfigMap, the agent reads back the same."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tscommon import pgcontract as pgc


def test_entries_round_trip_through_the_agents_parser() -> None:
    by_ip = pgc.EgressService("apps-db", target_ip="100.64.0.9", ports=(pgc.PortMap("TCP", 3000, 5432),),
                              health_check_endpoint="http://db.tailscale.svc.cluster.local:9002/healthz")
    by_name = pgc.EgressService("apps-web", target_fqdn="web.tailnet.ts.net",
                                ports=(pgc.PortMap("TCP", 3001, 443), pgc.PortMap("UDP", 3002, 53)))
    text = pgc.render_egress_services({s.name: pgc.render_entry(s) for s in (by_name, by_ip)})
    parsed = pgc.parse_egress_services(text)
    assert parsed.problems == () and parsed.services == (by_ip, by_name)
    # the controller reads its own document back to the same entries
    assert pgc.parse_entries(text) == {s.name: pgc.render_entry(s) for s in (by_ip, by_name)}


def test_hep_pings_round_trip() -> None:
    assert pgc.parse_hep_pings(pgc.render_hep_pings(4)) == 4 * pgc.HEP_PINGS_PER_REPLICA


def test_an_empty_document_is_no_services() -> None:
    assert pgc.parse_egress_services(pgc.render_egress_services({})).services == ()
