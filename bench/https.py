"""Benchmark: HTTPS with the user's certificate, against tailscaled's own plain-HTTP serve of the same backend.

    sudo .venv/bin/python -m bench.https [--seconds 8] [--concurrency 16] [--rounds 2] [--json out.json]
                                        [--record [--recorded TEXT]]

The lab (labtools.lab: headscale, a `client` tailscaled node, the `backend` namespace) with our agent in
userspace mode in the proxy namespace, a test CA's certificate for `proxy.tailnet.test`, and one serve config
holding every path, so all are measured in the same run against the same tailscaled and backend:

- `plain`:  port 80, tailscaled's plain-HTTP serve proxying to the backend (the reference);
- `tls`:    port 443, TCPForward to the agent's TLS listener (containerboot.tlsterm), which sends the decrypted
            bytes back into tailscaled (LocalAPI dial to its own address) to the plain-HTTP serve on port 10080,
            then the backend: what an Ingress with several paths or backends gets (docs/https.md);
- `direct`: port 8443, TCPForward to a second terminator of the same code that copies the decrypted bytes
            straight to the backend, without tailscaled's HTTP handling: what an Ingress whose every path goes
            to one backend gets (TS_TLS_BACKEND), and the ceiling of any in-agent HTTP router.

The backend (10.98.0.2:8090) and the load generator are small Go programs built at the first run into the
lab's cache (Go's net/http: so neither end is the bottleneck a Python server would be). The load generator
runs on the client node: `--concurrency` keep-alive connections for `--seconds` per measurement, `small`
(128-byte body) and `big` (1 MiB body); paths alternate ABBA per round.

Reported per path and size: requests per second, p50/p99 latency, MB/s; the ratio to `plain`; the CPU time
(user+system) of the proxy's processes (tailscaled, the agent, the direct terminator) per request; the
agent's RSS (VmRSS) and peak (VmHWM) after the run. Goals: small rps >= 0.5x plain, big throughput >= 0.8x.
`--record` writes the per-path table (`table`) to bench/results/https.json, shown in docs/https.md.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results import Results, Table, machine, record  # noqa: E402
from labtools.lab import Lab, default_bin_dir, ensure_binaries, wait_until  # noqa: E402
from tests.support.testca import TestCA  # noqa: E402

FQDN = "proxy.tailnet.test"
BACKEND = "10.98.0.2:8090"

GO_BACKEND = r'''package main

import (
	"bytes"
	"net/http"
	"os"
)

func main() {
	small := bytes.Repeat([]byte("s"), 128)
	big := bytes.Repeat([]byte("b"), 1<<20)
	http.HandleFunc("/small", func(w http.ResponseWriter, r *http.Request) { w.Write(small) })
	http.HandleFunc("/big", func(w http.ResponseWriter, r *http.Request) { w.Write(big) })
	panic(http.ListenAndServe(os.Args[1], nil))
}
'''

GO_LOAD = r'''package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"flag"
	"io"
	"net"
	"net/http"
	"os"
	"sort"
	"sync"
	"time"
)

func main() {
	url := flag.String("url", "", "URL")
	addr := flag.String("addr", "", "ip:port to dial")
	ca := flag.String("cacert", "", "CA file")
	c := flag.Int("c", 16, "connections")
	d := flag.Duration("d", 8*time.Second, "duration")
	flag.Parse()
	tc := &tls.Config{}
	if *ca != "" {
		pem, err := os.ReadFile(*ca)
		if err != nil {
			panic(err)
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(pem)
		tc.RootCAs = pool
	}
	dialer := &net.Dialer{Timeout: 10 * time.Second}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, n, a string) (net.Conn, error) {
			return dialer.DialContext(ctx, n, *addr)
		},
		TLSClientConfig: tc, MaxIdleConnsPerHost: *c, MaxConnsPerHost: *c, DisableCompression: true,
		ForceAttemptHTTP2: false, TLSNextProto: map[string]func(string, *tls.Conn) http.RoundTripper{},
	}
	cl := &http.Client{Transport: tr, Timeout: 60 * time.Second}
	for i := 0; i < *c; i++ { // warm every connection (handshakes outside the measurement)
		r, err := cl.Get(*url)
		if err == nil {
			io.Copy(io.Discard, r.Body)
			r.Body.Close()
		}
	}
	var mu sync.Mutex
	var lat []float64
	var errs int
	var nbytes int64
	end := time.Now().Add(*d)
	start := time.Now()
	var wg sync.WaitGroup
	for i := 0; i < *c; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []float64
			var b int64
			e := 0
			for time.Now().Before(end) {
				t := time.Now()
				r, err := cl.Get(*url)
				if err != nil {
					e++
					continue
				}
				n, _ := io.Copy(io.Discard, r.Body)
				r.Body.Close()
				if r.StatusCode != 200 {
					e++
					continue
				}
				b += n
				mine = append(mine, time.Since(t).Seconds()*1000)
			}
			mu.Lock()
			lat = append(lat, mine...)
			errs += e
			nbytes += b
			mu.Unlock()
		}()
	}
	wg.Wait()
	el := time.Since(start).Seconds()
	sort.Float64s(lat)
	q := func(p float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		return lat[int(p*float64(len(lat)-1))]
	}
	json.NewEncoder(os.Stdout).Encode(map[string]any{"requests": len(lat), "errors": errs, "seconds": el,
		"rps": float64(len(lat)) / el, "p50_ms": q(0.5), "p99_ms": q(0.99), "mb_s": float64(nbytes) / el / 1e6})
}
'''

DIRECT = r'''
import asyncio, sys
from containerboot.tlsterm import CertWatcher, FileSource, Terminator, tcp_dialer
async def main():
    host, port = sys.argv[2].rsplit(":", 1)
    t = Terminator(tcp_dialer(host, int(port)))
    w = CertWatcher(FileSource(sys.argv[1]), t, lambda: ())
    assert await w.refresh(), w.last_error
    await t.start("127.0.0.1", 10444)
    print("listening", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
'''


def build_tools() -> pathlib.Path:
    """The Go backend and load generator, built once into the lab's cache."""
    out = default_bin_dir().parent / "bench-https"
    out.mkdir(parents=True, exist_ok=True)
    for name, src in (("backend", GO_BACKEND), ("load", GO_LOAD)):
        binary = out / name
        if binary.exists() and (out / f"{name}.go").exists() and (out / f"{name}.go").read_text() == src:
            continue
        with tempfile.TemporaryDirectory() as d:
            (pathlib.Path(d) / "main.go").write_text(src)
            (pathlib.Path(d) / "go.mod").write_text("module benchtool\n\ngo 1.22\n")
            subprocess.run(["go", "build", "-o", str(binary), "."], cwd=d, check=True,
                           env={**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"})
        (out / f"{name}.go").write_text(src)
    return out


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def rss(pid: int) -> dict[str, int]:
    out = {}
    for line in open(f"/proc/{pid}/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0])
    return out


_LABELS = {"plain": "`plain` (tailscaled's HTTP serve)", "direct": "`direct` (your certificate, one backend)",
           "tls": "`tls` (your certificate, through tailscaled's serve)"}


def table(figures: Mapping[str, Any]) -> Table:
    """A run's figures as the docs show them: one row per path, small and 1 MiB responses, ratios to `plain`."""
    def ms(v: float) -> str:
        return f"{v:.1f}" if v < 100 else f"{v:.0f}"

    def cpu(us: float) -> str:
        return f"{us:.0f} us" if us < 1000 else f"{us / 1000:.1f} ms"

    def ratio(r: Mapping[str, Any]) -> str:
        return f" ({r['ratio_to_plain']:.2f}x)" if "ratio_to_plain" in r else ""
    rows = []
    for path in [p for p in ("plain", "direct", "tls") if p in figures["paths"]["small"]]:
        s, b = figures["paths"]["small"][path], figures["paths"]["big"][path]
        rows.append([_LABELS[path], f"{s['rps']:.0f}{ratio(s)}", f"{ms(s['p50_ms'])} / {s['p99_ms']:.0f} ms",
                     cpu(s["cpu_us_per_request"]), f"{b['mb_s']:.1f}{ratio(b)}",
                     f"{ms(b['p50_ms'])} / {b['p99_ms']:.0f} ms", cpu(b["cpu_us_per_request"])])
    return Table.of(["path", "small (128 B): requests/s", "p50 / p99", "CPU / request", "1 MiB: MB/s", "p50 / p99",
                     "CPU / request"], rows)


def main(argv: list[str] | None = None) -> int:
    a = argparse.ArgumentParser(prog="python -m bench.https", description=__doc__.split("\n\n")[0])
    a.add_argument("--seconds", type=float, default=8.0, help="per measurement")
    a.add_argument("--concurrency", type=int, default=16)
    a.add_argument("--rounds", type=int, default=2, help="ABBA rounds per size")
    a.add_argument("--paths", default="plain,tls,direct",
                   help="which paths to measure (comma separated; tailscaled's peak memory is the lab run's, so "
                        "one path per run tells which path costs it)")
    a.add_argument("--json", help="write the figures here too")
    a.add_argument("--record", action="store_true", help="write bench/results/https.json (docs/https.md)")
    a.add_argument("--recorded", default="", help="which run and machine, for the results file")
    args = a.parse_args(argv)
    chosen = [p for p in args.paths.split(",") if p]
    tools = build_tools()
    with Lab.create(bin_dir=ensure_binaries(upstream=False)) as lab:
        run = pathlib.Path(tempfile.mkdtemp(prefix="https-", dir=str(lab.run_dir)))
        ca = TestCA(str(run / "ca"))
        leaf = ca.issue(FQDN)
        certs = run / "tls"
        certs.mkdir()
        (certs / "tls.crt").write_bytes(leaf.cert_pem)
        (certs / "tls.key").write_bytes(leaf.key_pem)
        lab._popen("http", "go-backend", "backend", [str(tools / "backend"), BACKEND], {}, run / "backend.log")
        serve = run / "serve.json"
        backend = f"http://{BACKEND}"
        serve.write_text(json.dumps({
            "TCP": {"80": {"HTTP": True}, "443": {"TCPForward": "127.0.0.1:10443"}, "10080": {"HTTP": True},
                    "8443": {"TCPForward": "127.0.0.1:10444"}},
            "Web": {f"{FQDN}:80": {"Handlers": {"/": {"Proxy": backend}}},
                    f"{FQDN}:10080": {"Handlers": {"/": {"Proxy": backend}}}}}))
        agent = lab.start_agent({"TS_USERSPACE": "true", "TS_SERVE_CONFIG": str(serve),
                                 "TS_TLS_CERT_DIR": str(certs)})
        agent.wait_for_log("tls: listening on", timeout=120)
        direct = lab._popen("http", "direct-terminator", "proxy", [sys.executable, "-c", DIRECT, str(certs), BACKEND],
                            {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "")}, run / "direct.log")
        wait_until(lambda: "listening" in (run / "direct.log").read_text(), 30, 0.2, "the direct terminator")
        ip = agent.tailnet_ips()[0]
        tsd = children(agent.pid)
        procs = {"agent": agent.pid, "direct": direct.pid, **{f"tailscaled-{p}": p for p in tsd}}
        every = {"plain": (f"http://{FQDN}", f"{ip}:80", ""),
                 "tls": (f"https://{FQDN}", f"{ip}:443", ca.ca_path),
                 "direct": (f"https://{FQDN}:8443", f"{ip}:8443", ca.ca_path)}
        paths = {p: every[p] for p in chosen}

        def load(path: str, size: str, seconds: float) -> dict:
            url, addr, cacert = paths[path]
            before = {k: cpu_seconds(p) for k, p in procs.items()}
            cp = lab.exec("client", [str(tools / "load"), "-url", f"{url}/{size}", "-addr", addr, "-cacert", cacert,
                                     "-c", str(args.concurrency), "-d", f"{seconds}s"], timeout=seconds + 120)
            if cp.returncode != 0:
                raise RuntimeError(f"load {path} {size}: {cp.stderr[-2000:]}")
            r = json.loads(cp.stdout)
            cpu = {k: cpu_seconds(p) - before[k] for k, p in procs.items()}
            r["proxy_cpu_s"] = sum(cpu.values())
            r["cpu_us_per_request"] = r["proxy_cpu_s"] / max(1, r["requests"]) * 1e6
            r["cpu_by_process_s"] = cpu
            return r

        for path in paths:                    # every path works, and warm
            load(path, "small", 1.0)
        results: dict[str, dict[str, list[dict]]] = {s: {p: [] for p in paths} for s in ("small", "big")}
        order = list(paths)
        for size in ("small", "big"):
            for rnd in range(args.rounds):
                for path in (order if rnd % 2 == 0 else order[::-1]):
                    r = load(path, size, args.seconds)
                    results[size][path].append(r)
                    print(f"{size:5} {path:6} rps {r['rps']:8.1f}  p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms"
                          f"  {r['mb_s']:7.1f} MB/s  cpu/req {r['cpu_us_per_request']:7.0f} us  errors {r['errors']}",
                          flush=True)
        mem = {"agent": rss(agent.pid), "direct": rss(direct.pid), "tailscaled": rss(tsd[0]) if tsd else {}}
    figures: dict = {"seconds": args.seconds, "concurrency": args.concurrency, "rounds": args.rounds,
                     "memory_kb": mem, "load_average": os.getloadavg(), "paths": {}}
    for size, by_path in results.items():
        for path, runs in by_path.items():
            figures["paths"].setdefault(size, {})[path] = {
                k: statistics.median(r[k] for r in runs)
                for k in ("rps", "p50_ms", "p99_ms", "mb_s", "cpu_us_per_request")} | {
                "errors": sum(r["errors"] for r in runs)}
    print()
    for size, key, goal in (("small", "rps", 0.5), ("big", "mb_s", 0.8)):
        if "plain" not in paths:
            break
        base = figures["paths"][size]["plain"][key]
        for path in [p for p in ("tls", "direct") if p in paths]:
            ratio = figures["paths"][size][path][key] / base if base else 0.0
            figures["paths"][size][path]["ratio_to_plain"] = ratio
            print(f"{size}: {path} {key} {ratio:.2f}x plain (goal >= {goal}: {'MET' if ratio >= goal else 'NOT MET'})")
    print(f"agent RSS {mem['agent'].get('VmRSS', 0) / 1024:.1f} MiB (peak {mem['agent'].get('VmHWM', 0) / 1024:.1f}), "
          f"direct terminator {mem['direct'].get('VmRSS', 0) / 1024:.1f} MiB, tailscaled "
          f"{mem['tailscaled'].get('VmRSS', 0) / 1024:.1f} MiB (peak {mem['tailscaled'].get('VmHWM', 0) / 1024:.1f})")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(figures, indent=1))
    if {"plain", "tls", "direct"} <= set(chosen):
        record(Results("https", "python -m bench.https", args.recorded or
                       f"{machine()}; {args.concurrency} connections, {args.seconds:g} s per measurement, "
                       f"{args.rounds} ABBA rounds", {"main": table(figures)}), args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
