"""headscale's version matrix (v0.26.1, v0.27.1, v0.28.0, v0.29.2) in the lab: what the controller's provider and
a real tailscaled can do against each, as a table, and the REST API's answers recorded for the unit tests.

    python -m labtools.hsmatrix compat [--versions v0.26.1,...] [--record tests/data/headscale] [--write-docs]

For each version a lab (labtools.lab) runs that headscale; the controller's own provider
(controller.providers.headscale) runs in the lab's `client` namespace, as in a controller Pod, with an API key
from headscale's CLI, and every REST exchange it makes is kept (`--record` writes them, one JSON file per
scenario, under <dir>/<version>/; pre-auth keys in answers are replaced by a placeholder, the API key is never
in them). Checked, in this order:

- its version, detected from its answers (`GET /version`, its OpenAPI document);
- a pre-auth key without a user (tag-only) and with one; the errors of an unknown user, a wrong and an expired
  API key, each turned into a message naming the fix;
- tailscaled v1.102.3 logging in with the provider's key, with its addresses, advertising a subnet route and
  an exit node; the node's tags as the provider reads them; re-tagging without a policy, with one whose
  `tagOwners` has the tags, and with a tag outside it; the routes approved through the API, and a client
  reaching the backend through the subnet route; the node deleted, and deleted again (already gone);
- every policy example of docs/install-headscale.md marked for this version, loaded into it through the API;
  the route example's `autoApprovers` approving a second node's routes by themselves.

With `--e2e`, per version, the proxies' e2e modules (E2E_MODULES) and then, on one cluster for all versions,
the controller's user story (labtools.hsstory).

The table (a line per feature, a column per version: works, or refused and why) is printed. `--write-docs`
after a run of the full matrix with `--e2e` records it in bench/results/compat.json and renders it into
docs/install-headscale.md (its figure block, as `make figures` does). `--check` exits 1 on a failure, or when a
cell's verdict (`verdict`: works, refused, ...; not the addresses, timings or IDs in it) differs from that
table. Needs root.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.results import Results, Table, load, record

from .lab import HEADSCALE_VERSIONS, REPO_ROOT, Lab, wait_until

DOCS = REPO_ROOT / "docs" / "install-headscale.md"
#: A policy example in the docs: the marker line before its ```json block names the example and its minors.
POLICY_MARK = re.compile(r"<!-- headscale-policy (\w+) ([\d. ]+) -->\s*\n```json\n(.*?)\n```", re.S)
#: The placeholder that replaces a pre-auth key in a recorded answer.
KEY_PLACEHOLDER = "hskey-auth-RECORDED"
SUBNET = "10.98.0.0/24"


def doc_policies(text: str | None = None) -> list[tuple[str, tuple[str, ...], str]]:
    """The policy examples of the install guide: (name, minors like "0.26", the JSON text)."""
    text = DOCS.read_text() if text is None else text
    return [(m.group(1), tuple(m.group(2).split()), m.group(3)) for m in POLICY_MARK.finditer(text)]


def minor(version: str) -> str:
    m = re.match(r"v?(\d+\.\d+)", version)
    return m.group(1) if m else version


# ---------------------------------------------------------------- inside the lab (the client namespace)

def scrub(doc: Any) -> Any:
    """A recorded answer without the pre-auth keys it carries."""
    if isinstance(doc, dict):
        return {k: (KEY_PLACEHOLDER if k == "key" and isinstance(v, str) and v else scrub(v)) for k, v in doc.items()}
    if isinstance(doc, list):
        return [scrub(v) for v in doc]
    return doc


def reduce_swagger(doc: Any) -> Any:
    """The OpenAPI document, reduced to what the version's detection reads (its paths, the node's fields)."""
    if not isinstance(doc, dict):
        return doc
    node = ((doc.get("definitions") or {}).get("v1Node") or {}).get("properties") or {}
    return {"paths": {p: {} for p in sorted(doc.get("paths") or {})},
            "definitions": {"v1Node": {"properties": {k: {} for k in sorted(node)}}}}


async def _inner(req: Mapping[str, Any]) -> dict:
    """Run the provider's calls of `req["ops"]` against the lab's headscale; results and the exchanges."""
    import httpx

    exchanges: list[dict] = []

    class Recording(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            r = await super().handle_async_request(request)
            body = await r.aread()
            try:
                sent = json.loads(request.content) if request.content else None
            except ValueError:
                sent = None
            try:
                answer: Any = json.loads(body)
                if request.url.path.startswith("/swagger/"):
                    answer = reduce_swagger(answer)
            except ValueError:
                answer = body.decode(errors="replace")
            exchanges.append({"method": request.method, "path": request.url.path, "request": scrub(sent),
                              "status": r.status_code, "response": scrub(answer)})
            headers = [(k, v) for k, v in r.headers.items() if k.lower() not in ("content-encoding", "content-length")]
            return httpx.Response(r.status_code, headers=headers, content=body, request=request)

    results = []
    for op in req["ops"]:
        start = len(exchanges)
        out = await run_op(op, req["url"], req["api_key"], Recording())
        results.append({"op": op, "result": out, "exchanges": exchanges[start:]})
    return {"results": results}


async def run_op(op: Mapping[str, Any], url: str, api_key: str, transport: Any) -> Any:
    """One of the provider's calls, as the controller makes it, through `transport` (recording in the lab,
    replaying the recording in the unit tests); its result, or its error as the user sees it."""
    from controller.providers import ProviderError
    from controller.providers.headscale import HeadscaleProvider
    from controller.providers.hscompat import Capabilities

    caps = None
    if op.get("assume_newest"):     # as when detection found nothing: headscale's own answer is seen
        caps = Capabilities("0.29 (assumed)", (0, 29), detected=False)
    p = HeadscaleProvider(url, api_key=op.get("api_key", api_key), user=op.get("user", ""), transport=transport,
                          capabilities=caps)
    out: Any
    try:
        kind = op["op"]
        if kind == "detect":
            c = await p.detect()
            out = {"version": c.version, "level": list(c.level), "summary": c.summary(user_set=False)}
        elif kind == "create":
            out = {"key": await p.create_auth_key(tuple(op["tags"]))}
        elif kind == "tags":
            t = await p.device_tags(op["id"])
            out = {"tags": None if t is None else list(t)}
        elif kind == "settags":
            await p.set_device_tags(op["id"], tuple(op["tags"]))
            out = {"set": True}
        elif kind == "approve":
            routes = await p.approve_routes(op["id"], tuple(op["routes"]))
            out = {"approved": None if routes is None else list(routes)}
        elif kind == "delete":
            out = {"deleted": await p.delete_device(op["id"])}
        elif kind == "policy":
            await p._caps()
            answer = await p._client.put("/api/v1/policy", json={"policy": op["policy"]}, headers=p._headers())
            out = {"status": answer.status_code, "message": _message(answer.text)}
        else:
            raise ValueError(f"unknown op {kind}")
    except ProviderError as e:
        out = {"error": str(e), "reason": e.reason}
    finally:
        await p.aclose()
    return out


def _message(body: str) -> str:
    from controller.providers.hscompat import error_message
    return error_message(body)


# ---------------------------------------------------------------- the driver (root)

@dataclass
class Run:
    """One version's run: its lab, the API key, the features' verdicts and the recorded scenarios."""
    version: str
    lab: Lab
    api_key: str
    user_id: str
    cells: dict[str, str] = field(default_factory=dict)
    scenarios: dict[str, list[dict]] = field(default_factory=dict)

    def call(self, scenario: str, *ops: dict) -> list[dict]:
        req = {"url": self.lab.login_server, "api_key": self.api_key, "ops": list(ops)}
        cp = self.lab.exec("client", [sys.executable, "-m", "labtools.hsmatrix", "inner"], timeout=120,
                           input=json.dumps(req), env={"PYTHONPATH": str(REPO_ROOT)})
        if cp.returncode != 0:
            raise RuntimeError(f"{scenario}: the provider's run failed:\n{cp.stderr[-3000:]}")
        results = json.loads(cp.stdout.strip().splitlines()[-1])["results"]
        for r in results:       # the (wrong or expired) API keys of the error scenarios stay out of the record
            if "api_key" in r["op"]:
                r["op"]["api_key"] = "hskey-api-RECORDED-NOT-VALID"
        self.scenarios.setdefault(scenario, []).extend(results)
        return [r["result"] for r in results]


FEATURES = ("detected", "tailscaled login", "tag-only key", "key for a user", "node tags", "re-tag",
            "routes", "subnet route", "deletion", "errors", "policy: minimal", "policy: tags", "policy: routes",
            "policy: grants")


def _short(text: str, n: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def run_version(version: str, record: Path | None) -> dict[str, str]:
    with Lab.create(hs_version=version, client=True) as lab:
        lab.create_user("admin")
        out = lab.hs("apikeys", "create", "--expiration", "1h")
        api_key = out if isinstance(out, str) else str(out.get("key") or out)
        run = Run(version, lab, api_key.strip(), str(lab.user_id))
        try:
            _checks(run)
        finally:
            if record is not None:
                d = record / version
                d.mkdir(parents=True, exist_ok=True)
                for name, results in run.scenarios.items():
                    (d / f"{name}.json").write_text(json.dumps(scrub(results), indent=1, sort_keys=True) + "\n")
        return run.cells


def _checks(run: Run) -> None:
    lab, cells = run.lab, run.cells
    det = run.call("detect", {"op": "detect"})[0]
    cells["detected"] = f"{det['version']} (API {'.'.join(map(str, det['level']))})"
    # keys
    tag_only, user_key = run.call("keys", {"op": "create", "tags": ["tag:k8s"]},
                                  {"op": "create", "tags": ["tag:k8s"], "user": run.user_id})
    run.call("key_tag_only_undetected", {"op": "create", "tags": ["tag:k8s"], "assume_newest": True})
    cells["tag-only key"] = "works" if "key" in tag_only else "refused: " + _short(tag_only["error"])
    cells["key for a user"] = "works" if "key" in user_key else "refused: " + _short(user_key["error"])
    errors = run.call("errors", {"op": "create", "tags": ["tag:k8s"], "user": "9999"},
                      {"op": "create", "tags": ["tag:k8s"], "user": run.user_id,
                       "api_key": "hskey-api-AAAAAAAAAAAA-BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"})
    expired = lab.hs("apikeys", "create", "--expiration", "1h")
    expired = (expired if isinstance(expired, str) else str(expired.get("key") or expired)).strip()
    # "hskey-api-<12-character prefix>-<secret>" from 0.28 (the prefix may hold a '-'); "<prefix>.<secret>" before
    prefix = expired[10:22] if expired.startswith("hskey-api-") else expired.split(".")[0]
    lab.hs("apikeys", "expire", "--prefix", prefix)
    errors += run.call("errors", {"op": "create", "tags": ["tag:k8s"], "user": run.user_id, "api_key": expired})
    fixes = ("headscale users list", "headscale apikeys create", "headscale apikeys create")
    ok = all(fix in (e.get("error") or "") for e, fix in zip(errors, fixes, strict=True))
    cells["errors"] = "each names its fix" if ok else "raw: " + _short("; ".join(str(e) for e in errors))
    # a real tailscaled with the provider's key
    key = tag_only.get("key") or user_key.get("key")
    try:
        lab.start_node("router", "proxy", [f"--advertise-routes={SUBNET}", "--advertise-exit-node"],
                       accept_routes=False, authkey=key, timeout=60)
        ips = lab.tailnet_ips("router")
        cells["tailscaled login"] = f"works ({', '.join(i for i in ips if i)})"
    except Exception as e:      # the table says what failed; the rest needs the node
        cells["tailscaled login"] = "failed: " + _short(str(e))
        return
    node = wait_until(lambda: lab.hs_node("router"), 30, 0.3, "the router in headscale")
    nid = str(node["id"])
    tags = run.call("node", {"op": "tags", "id": nid})[0]
    cells["node tags"] = "works" if tags.get("tags") == ["tag:k8s"] else f"read {tags}"
    retag = _retag(run, nid)
    cells["re-tag"] = retag
    lab.exec("proxy", ["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"], timeout=10)
    approved = run.call("routes", {"op": "approve", "id": nid, "routes": [SUBNET, "0.0.0.0/0"]})[0]
    want = sorted(["0.0.0.0/0", "::/0", SUBNET])
    cells["routes"] = ("works (subnet and exit node)" if approved.get("approved") == want
                       else "refused: " + _short(str(approved)))
    lab.start_http_server("backend", port=8081, body_marker="subnet-ok")
    try:
        lab.wait_curl("client", lab.url(lab.backend_ipv4, 8081), "subnet-ok", timeout=30)
        cells["subnet route"] = "works"
    except Exception as e:
        cells["subnet route"] = "failed: " + _short(str(e))
    gone = run.call("delete", {"op": "delete", "id": nid}, {"op": "delete", "id": nid}, {"op": "tags", "id": nid})
    cells["deletion"] = ("works" if gone == [{"deleted": True}, {"deleted": False}, {"tags": None}]
                         else "failed: " + _short(str(gone)))
    _policies(run)


def _retag(run: Run, nid: str) -> str:
    """Re-tagging with no policy, with one whose tagOwners has the tags, and with a tag outside it."""
    # a tag owns a tag from 0.28; before, owners are users and groups
    owner = "tag:k8s" if minor(run.version) >= "0.28" else "admin@"
    policy = {"tagOwners": {"tag:k8s": ["admin@"], "tag:web": [owner]},
              "acls": [{"action": "accept", "src": ["*"], "dst": ["*:*"]}]}
    none, pol, web, nope, back, reset = run.call(
        "retag", {"op": "settags", "id": nid, "tags": ["tag:k8s", "tag:web"]},
        {"op": "policy", "policy": json.dumps(policy)},
        {"op": "settags", "id": nid, "tags": ["tag:k8s", "tag:web"]},
        {"op": "settags", "id": nid, "tags": ["tag:k8s", "tag:nope"]},
        {"op": "settags", "id": nid, "tags": ["tag:k8s"]},
        {"op": "policy", "policy": run.lab.hs_open_policy})
    if pol.get("status") != 200:
        return "policy refused: " + _short(str(pol))
    if "error" in web:
        return "refused: " + _short(web["error"])
    said = []
    said.append("without a policy: " + ("refused (tagOwners)" if "error" in none else "accepted"))
    said.append("a tag outside tagOwners: " + ("refused" if "error" in nope else "accepted"))
    return "works (" + "; ".join(said) + ")"


def _policies(run: Run) -> None:
    got: dict[str, list[str]] = {}
    for name, minors, text in doc_policies():
        if minor(run.version) not in minors:
            continue
        res = run.call("policies", {"op": "policy", "policy": text})[0]
        got.setdefault(name, []).append("accepted" if res.get("status") == 200 else
                                        f"refused: {_short(res.get('message') or str(res))}")
    # 0.29's minimal and grants examples, as a user of an older headscale following the newest guide would load
    # them: refused, or (worse) accepted with a part ignored
    for name in ("minimal", "grants"):
        newest = [t for n, m, t in doc_policies() if n == name and "0.29" in m]
        if newest and minor(run.version) != "0.29":
            res = run.call("policies", {"op": "policy", "policy": newest[0]})[0]
            run.cells[f"policy: {name} of 0.29"] = ("accepted" if res.get("status") == 200 else
                                                    "refused: " + _short(res.get("message") or ""))
    for name in ("minimal", "tags", "routes", "grants"):
        verdicts = got.get(name)
        run.cells[f"policy: {name}"] = ("; ".join(verdicts) if verdicts else "no example (not available)")
    routes = [t for n, m, t in doc_policies() if n == "routes" and minor(run.version) in m]
    if routes:
        run.call("policies", {"op": "policy", "policy": routes[0]})
        _auto_approval(run)
    run.call("policies", {"op": "policy", "policy": run.lab.hs_open_policy})


def _auto_approval(run: Run) -> None:
    """A second node advertising the subnet under the route example's autoApprovers: approved by headscale."""
    lab = run.lab
    key = lab.preauth_key(reusable=False, tags=("tag:k8s",)) if minor(run.version) >= "0.28" else None
    if key is None:
        k = lab.hs("preauthkeys", "create", "--expiration", "1h", "--user", str(lab.user_id), "--tags", "tag:k8s")
        key = k["key"] if isinstance(k, dict) else str(k)
    try:
        # a namespace of its own: the first router's tailscaled still holds the proxy namespace's TUN and port
        if "router2" not in lab.namespaces:
            lab.add_namespace("router2")
        lab.start_node("router2", "router2", [f"--advertise-routes={SUBNET}"], accept_routes=False, authkey=key)
        node = wait_until(lambda: (n := lab.hs_node("router2")) and SUBNET in (
            n.get("approved_routes") or n.get("approvedRoutes") or []) and n, 30, 0.5, "auto-approval")
        run.cells["policy: routes"] += f"; auto-approved {SUBNET} for node {node['id']}"
    except Exception as e:
        run.cells["policy: routes"] += "; auto-approval failed: " + _short(str(e))


#: The proxies' end-to-end tests run against each version with `--e2e` (our agent and tailscaled v1.102.3).
E2E_MODULES = ("netns-tests/test_ingress_e2e.py", "netns-tests/test_egress_e2e.py", "netns-tests/test_connector_e2e.py")
E2E_FEATURE = "proxies: L3 ingress, egress, subnet router, exit node"


def run_e2e(version: str) -> str:
    """The proxies' e2e modules (E2E_MODULES) with this headscale: pytest's summary line, and on a failure the
    failed tests with pytest's one-line reason (the table's cell), its whole report on standard error."""
    import subprocess
    cp = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *E2E_MODULES],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800,
                        # COLUMNS: pytest cuts its summary's lines to the terminal's width, the reasons first
                        env={**os.environ, "HEADSCALE_VERSION": version, "COLUMNS": "400"})
    lines = [ln for ln in cp.stdout.splitlines() if ln.strip()]
    summary = lines[-1].strip("= ") if lines else cp.stderr[-300:]
    if cp.returncode == 0:
        return f"works ({summary})"
    print(f"[compat] headscale {version}: the proxies' e2e modules failed; pytest's report follows", file=sys.stderr)
    print("\n".join(cp.stdout.splitlines()[-200:]), cp.stderr[-2000:], sep="\n", file=sys.stderr)
    # "FAILED netns-tests/m.py::test_x - AssertionError: ...": the test's name and the reason's start
    failed = [_short(ln.split("::", 1)[-1], 200) for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    return f"failed ({_short(summary)}: {'; '.join(failed) or 'no test named'})"


def table(rows: Mapping[str, Mapping[str, str]]) -> Table:
    """The matrix: a line per feature, a column per version."""
    from . import hsstory
    versions = list(rows)
    feats = [f for f in (*FEATURES, "policy: minimal of 0.29", "policy: grants of 0.29", E2E_FEATURE,
                         *hsstory.FEATURES)
             if any(f in rows[v] for v in versions)]
    return Table.of(["feature", *(f"headscale {v}" for v in versions)],
                    [[f, *(rows[v].get(f, "—") for v in versions)] for f in feats])


#: The docs' table is bench/results/compat.json's table "matrix", rendered by `make figures`.
RESULTS_NAME, RESULTS_TABLE = "compat", "matrix"


def record_matrix(rows: Mapping[str, Mapping[str, str]], seconds: Mapping[str, float], total: float) -> Path:
    """bench/results/compat.json from a run of the full matrix, and the docs' table rendered from it."""
    per = ", ".join(f"{v} {seconds[v] / 60:.1f} min" for v in rows)
    res = Results(RESULTS_NAME, "make compat",
                  f"the full matrix of {time.strftime('%Y-%m-%d', time.gmtime())} with --e2e on "
                  f"{os.cpu_count()} shared cores, {total / 60:.0f} min in all: per version (its lab checks, the "
                  f"proxies' e2e modules, the controller's story) {per}; the images, the cluster and the "
                  f"controller's install, once, {seconds.get('setup', 0.0) / 60:.1f} min",
                  {RESULTS_TABLE: table(rows)})
    path = record(res, flag=True)
    assert path is not None
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import render_figures
    DOCS.write_text(render_figures.render(DOCS.read_text(), DOCS))
    return path


def verdict(cell: str) -> tuple[str, ...]:
    """What a cell says, without what changes from run to run (addresses, timings, IDs, a message's words): the
    first word of each `;`-separated part once parenthesised asides are dropped; a refusal or failure is that
    word alone."""
    # the controller's start-up line: what it says after naming the version (the column has it)
    cell = re.sub(r"^headscale \S+?(, API of [\d.]+)?: ", "", cell.strip())
    first = re.split(r"[\s:]", cell, maxsplit=1)[0]
    if first in ("refused", "failed", "raw", "lab", "policy", "read", "not"):
        return (first,)
    text = re.sub(r"\([^()]*\)", "", cell)
    return tuple(re.split(r"[\s:]", p.strip(), maxsplit=1)[0] for p in text.split(";") if p.strip())


def differences(rows: Mapping[str, Mapping[str, str]], docs: Table | None = None) -> list[str]:
    """The cells of this run whose verdict differs from the docs' table (bench/results/compat.json), for the
    versions and features both have; a feature or version the docs do not have is a difference too."""
    if docs is None:
        docs = load(RESULTS_NAME).tables[RESULTS_TABLE]
    cols = list(docs.columns)
    want = {(c.removeprefix("headscale "), r[0]): r[i] for r in docs.rows for i, c in enumerate(cols) if i}
    feats = {r[0] for r in docs.rows}
    out = []
    for v, cells in rows.items():
        if f"headscale {v}" not in cols:
            out.append(f"{v}: not in the docs' table (its columns: {', '.join(cols[1:])})")
            continue
        for feat, cell in cells.items():
            if feat not in feats:
                out.append(f"{v} {feat}: not a row of the docs' table")
            elif verdict(cell) != verdict(want[(v, feat)]):
                out.append(f"{v} {feat}: {cell!r}, the docs say {want[(v, feat)]!r}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["inner"]:
        print(json.dumps(asyncio.run(_inner(json.loads(sys.stdin.read())))))
        return 0
    ap = argparse.ArgumentParser(prog="python -m labtools.hsmatrix")
    ap.add_argument("cmd", choices=["compat", "table"],
                    help="compat: run the matrix; table: the table of each version's last recorded run (--record)")
    ap.add_argument("--versions", default=os.environ.get("HEADSCALE_VERSIONS", ",".join(HEADSCALE_VERSIONS)))
    ap.add_argument("--record", type=Path, help="write the REST exchanges under this directory")
    ap.add_argument("--write-docs", action="store_true",
                    help="after a run of the full matrix with --e2e: record bench/results/compat.json and render "
                         "the table into docs/install-headscale.md (as `make figures` does)")
    ap.add_argument("--e2e", action="store_true",
                    help="also run the proxies' e2e tests and the controller's story in a cluster on each version")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when anything failed, or a cell's verdict differs from the docs' table (a refusal "
                         "the version is known for is not a failure)")
    a = ap.parse_args(args)
    versions = [x.strip() for x in a.versions.split(",") if x.strip()]
    rows: dict[str, dict[str, str]] = {}
    if a.cmd == "table":
        if a.record is None:
            ap.error("table needs --record <dir> (where compat wrote each version's run)")
        if a.write_docs:
            ap.error("the docs' table comes from a run of the full matrix: make compat (not table --write-docs)")
        for v in versions:
            if (a.record / v / "table.json").exists():
                rows[v] = json.loads((a.record / v / "table.json").read_text())
        print(table(rows).markdown())
        return 0
    full = a.e2e and set(versions) == set(HEADSCALE_VERSIONS)
    if a.write_docs and not full:
        print(f"[compat] the docs' table is written by a run of the full matrix ({', '.join(HEADSCALE_VERSIONS)}) "
              f"with --e2e only: not written", file=sys.stderr)
    t_all = time.monotonic()
    seconds: dict[str, float] = {}
    for v in versions:
        t0 = time.monotonic()
        try:
            rows[v] = run_version(v, a.record)
        except Exception as e:       # one version's failure is a line of the table, the others still run
            rows[v] = {"detected": "lab failed: " + _short(str(e), 300)}
        if a.e2e:
            rows[v][E2E_FEATURE] = run_e2e(v)
        seconds[v] = time.monotonic() - t0
        print(f"[compat] headscale {v}: {seconds[v]:.0f}s", file=sys.stderr)
    if a.e2e:
        from . import hsstory
        t0 = time.monotonic()
        story_seconds: dict[str, float] = {}
        try:
            story = hsstory.run(versions, say=lambda m: print(m, file=sys.stderr), seconds=story_seconds)
        except Exception as e:      # the cluster itself failed: every version's row says so
            story = {v: {hsstory.STARTUP: "failed: the cluster: " + _short(str(e), 300)} for v in versions}
        for v in versions:
            rows[v].update(story.get(v, {}))
            seconds[v] += story_seconds.get(v, 0.0)
        seconds["setup"] = story_seconds.get("setup", 0.0)
        print(f"[compat] the controller's story, {len(versions)} version(s) on one cluster: "
              f"{time.monotonic() - t0:.0f}s", file=sys.stderr)
    if a.record is not None:
        for v in versions:
            (a.record / v).mkdir(parents=True, exist_ok=True)
            (a.record / v / "table.json").write_text(json.dumps(rows[v], indent=1) + "\n")
    total = time.monotonic() - t_all
    print(table(rows).markdown())
    print(f"[compat] {len(versions)} version(s): {total:.0f}s", file=sys.stderr)
    if a.write_docs and full:
        print(f"[compat] recorded {record_matrix(rows, seconds, total)}; docs/install-headscale.md rendered",
              file=sys.stderr)
    if a.check:
        bad = failures(rows) + differences(rows)
        if bad:
            print("[compat] failed:\n  " + "\n  ".join(bad), file=sys.stderr)
            return 1
    return 0


def failures(rows: Mapping[str, Mapping[str, str]]) -> list[str]:
    """The cells that are failures rather than what a version is known to refuse: a step that failed, an error
    passed on raw, an example of the guide its own version refused, an auto-approval that did not happen."""
    bad = []
    for v, cells in rows.items():
        for feat, cell in cells.items():
            own_policy = feat in ("policy: minimal", "policy: tags", "policy: routes", "policy: grants")
            if (cell.startswith(("failed", "lab failed", "raw:", "policy refused", "read "))
                    or (own_policy and "refused" in cell) or "auto-approval failed" in cell):
                bad.append(f"{v} {feat}: {cell}")
    return bad


if __name__ == "__main__":
    sys.exit(main())
