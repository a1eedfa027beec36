"""Firewall mode detection and IPv6 capability probes, as upstream does them (spec sections 1.2-1.4).

Kept behaviour-compatible on purpose: tailscaled (started by the agent, same environment) runs the same
detection, and the two should agree on the mode.
"""
from __future__ import annotations

import logging
import os
import subprocess
from typing import Callable


def which(name: str) -> str | None:
    """shutil.which for a bare command name: the first executable file of that name on PATH. (shutil loads
    bz2 and lzma for its archive functions, about 0.7 MB of the agent's resident memory.) A name with a slash
    is checked as it is."""
    if os.sep in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    for d in (os.environ.get("PATH") or os.defpath).split(os.pathsep):
        path = os.path.join(d or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


log = logging.getLogger("containerboot")

NFTABLES = "nftables"
IPTABLES = "iptables"


def _run(argv: list[str], timeout: float = 20.0) -> str:
    """Run a command, return stdout; FileNotFoundError if the binary is missing, RuntimeError if it fails."""
    if which(argv[0]) is None:
        raise FileNotFoundError(argv[0])
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def detect_iptables(run: Callable[[list[str]], str] = _run) -> tuple[int, Exception | None]:
    """Count `-A` lines of `iptables -S` + `ip6tables -S` (filter table only, like upstream).

    The error is set only when both commands failed; it is a FileNotFoundError when (at least) one of the
    failures was a missing binary, which is what makes the default mode flip to nftables.
    """
    count, errors = 0, []
    for cmd in ("iptables", "ip6tables"):
        try:
            out = run([cmd, "-S"])
        except (FileNotFoundError, RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            errors.append(e)
            continue
        count += sum(1 for line in out.splitlines() if line.lstrip().startswith("-A"))
    if len(errors) == 2:
        nf = [e for e in errors if isinstance(e, FileNotFoundError)]
        return count, (nf[0] if nf else errors[0])
    return count, None


def _nft_json(cmds: list[dict]) -> dict:
    import nftables
    n = nftables.Nftables()
    rc, out, err = n.json_cmd({"nftables": cmds})
    if rc != 0:
        raise RuntimeError(err.strip() or f"libnftables returned {rc}")
    return out or {}


def detect_nftables(ipv6: bool | None = None) -> tuple[int, Exception | None]:
    """Probe nftables NAT support with a throw-away table per family, then count all rules of all tables."""
    if ipv6 is None:
        ipv6 = check_ipv6() is None
    try:
        for fam in (("ip", "ip6") if ipv6 else ("ip",)):
            # Create and delete in separate batches: a kernel that cannot register a nat/postrouting chain
            # (partial support, e.g. some COS kernels) fails on the add.
            _nft_json([{"add": {"table": {"family": fam, "name": "ts-test-nat"}}},
                       {"add": {"chain": {"family": fam, "table": "ts-test-nat", "name": "ts-test-postrouting",
                                          "type": "nat", "hook": "postrouting", "prio": 100,
                                          "policy": "accept"}}}])
            _nft_json([{"delete": {"table": {"family": fam, "name": "ts-test-nat"}}}])
        out = _nft_json([{"list": {"ruleset": None}}])
    except Exception as e:  # libnftables missing, EPERM, unsupported kernel
        return 0, e
    return sum(1 for o in out.get("nftables", []) if "rule" in o), None


def pick_firewall_mode_from_installed_rules() -> str:
    ipt_count, ipt_err = detect_iptables()
    nft_count, nft_err = detect_nftables()
    if nft_count > 0 and ipt_count == 0:
        return NFTABLES
    if ipt_count > 0 and nft_count == 0:
        return IPTABLES
    if nft_err is None:
        return NFTABLES
    return IPTABLES     # iptables usable, or nothing usable (upstream's fallback) alike


def detect_firewall_mode(mode: str = "") -> str:
    """Upstream's decision (spec 1.2) for containerboot, which always has an empty preference hint."""
    if mode == "":
        _, err = detect_iptables()
        if isinstance(err, FileNotFoundError):
            mode = NFTABLES
    if mode == "auto":
        return pick_firewall_mode_from_installed_rules()
    if mode == NFTABLES:
        return NFTABLES
    return IPTABLES


# ------------------------------------------------------------------------------------------------- IPv6 probes

def _parse_bool(text: str) -> bool:
    """Go strconv.ParseBool on trimmed content."""
    t = text.strip()
    if t in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if t in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    raise ValueError(f"invalid boolean {t!r}")


def check_ipv6(root: str = "/") -> str | None:
    """None if IPv6 is usable for policy routing and firewalling, else the reason (spec 1.4 CheckIPv6)."""
    base = os.path.join(root, "proc/sys/net/ipv6")
    if not os.path.isdir(base):
        return "IPv6 is not supported by the kernel (no /proc/sys/net/ipv6)"
    try:
        with open(os.path.join(base, "conf/all/disable_ipv6")) as f:
            if _parse_bool(f.read()):
                return "IPv6 is disabled (net.ipv6.conf.all.disable_ipv6=1)"
    except (OSError, ValueError) as e:
        return f"cannot read net.ipv6.conf.all.disable_ipv6: {e}"
    try:
        with open(os.path.join(base, "conf/all/disable_policy")) as f:
            if _parse_bool(f.read()):
                return "IPv6 policy is disabled (net.ipv6.conf.all.disable_policy=1)"
    except OSError:
        pass
    except ValueError as e:
        return f"cannot parse net.ipv6.conf.all.disable_policy: {e}"
    if root not in ("", "/"):
        return None     # test roots: no netlink probe against the real kernel
    return _check_ip_rule_v6()


def _check_ip_rule_v6() -> str | None:
    """IPv6 policy routing works: a rule exists, or a probe rule can be added (and is always removed).

    Through iproute2's `ip` (a required package) rather than pyroute2: importing pyroute2 costs the agent
    about 10 MB of resident memory for the rest of its life, for one probe at start."""
    if which("ip") is None:
        return "IPv6 policy routing unknown: the ip command (iproute2) is not installed"
    try:
        listed = subprocess.run(["ip", "-6", "rule", "show"], capture_output=True, text=True, timeout=10)
        if listed.returncode == 0 and listed.stdout.strip():
            return None
        probe = ["pref", "1234", "fwmark", "0x80000", "table", "52"]
        added = subprocess.run(["ip", "-6", "rule", "add", *probe], capture_output=True, text=True, timeout=10)
        subprocess.run(["ip", "-6", "rule", "del", *probe], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"IPv6 policy routing unavailable: {e}"
    if added.returncode != 0:
        return f"IPv6 policy routing unavailable: {added.stderr.strip() or listed.stderr.strip()}"
    return None


def ip6tables_nat_available(run: Callable[[list[str]], str] = _run) -> bool:
    """HasIPV6NAT for the iptables runner: nat table listable, registered, or loadable."""
    if which("ip6tables") is None:
        return False
    try:
        run(["ip6tables", "-t", "nat", "-S"])
        return True
    except Exception:
        pass
    try:
        with open("/proc/net/ip6_tables_names") as f:
            if "nat\n" in f.read():
                return True
    except OSError:
        pass
    try:
        return subprocess.run(["modprobe", "ip6table_nat"], capture_output=True, timeout=20).returncode == 0
    except Exception:
        return False


def ipv6_nat_available(mode: str) -> bool:
    """HasIPV6NAT() for the chosen mode (spec 1.4)."""
    reason = check_ipv6()
    if reason is not None:
        log.info("IPv6 firewalling disabled: %s", reason)
        return False
    if mode == NFTABLES:
        return True
    return ip6tables_nat_available()


# ----------------------------------------------------------------------------------------- iptables variants

def iptables_variant() -> str:
    """Which iptables flavour to drive: "legacy", "nft", or "" (the plain `iptables` binary).

    Like kube-proxy's iptables-wrapper: use the flavour that already holds rules (tailscaled's `ts-` chains
    count most, they mean tailscaled already picked it); otherwise the plain `iptables` on $PATH, which is also
    what tailscaled will use.
    """
    counts: dict[str, tuple[int, int]] = {}
    for variant in ("legacy", "nft"):
        binary = f"iptables-{variant}-save"
        if which(binary) is None:
            continue
        total = ts = 0
        for b in (binary, f"ip6tables-{variant}-save"):
            try:
                out = _run([b])
            except Exception:
                continue
            for line in out.splitlines():
                if line.startswith("-A "):
                    total += 1
                    if " ts-" in line or line.startswith("-A ts-"):
                        ts += 1
        counts[variant] = (ts, total)
    if not counts:
        return ""
    if len(counts) == 1 and which("iptables") is None:
        return next(iter(counts))
    ranked = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)
    if ranked[0][1] > (0, 0) and (len(ranked) == 1 or ranked[0][1] != ranked[1][1]):
        return ranked[0][0]
    return "" if which("iptables") else ranked[0][0]
