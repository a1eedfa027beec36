"""Resolution of TS_EXPERIMENTAL_DEST_DNS_NAME with record TTLs, and the re-resolution schedule.

Upstream re-resolves every 10 minutes whatever the records say; here the next lookup happens when the
answer's TTL runs out (bounded to [5 s, 10 min]), and after a failure with a backoff of 1 s, 2 s, 4 s, ... up
to 1 min (upstream's goes on to 10 min: after a long DNS outage the name's backends would stay stale, and
`/status` keep the error, for up to 10 minutes; one lookup a minute costs nothing).

The standard library's resolver hides TTLs, so lookups go through dnspython's `dns.asyncresolver`, which reads
/etc/resolv.conf (nameservers, `search`, `ndots`, `timeout`, `rotate`, `edns0`), follows CNAME chains, retries
over TCP when an answer is truncated, and reports the smallest TTL of the chain. dnspython is imported only when
a lookup is made, so configurations without a DNS target never load it.
"""
from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass

from .state import IP

MIN_TTL = 5.0
MAX_TTL = 600.0
MAX_BACKOFF = 60.0


class DNSError(Exception):
    """A lookup failed (timeout, SERVFAIL, no addresses, ...)."""


@dataclass(frozen=True)
class Answer:
    addresses: tuple[IP, ...]
    ttl: float  # seconds until the answer should be refreshed


def next_delay(*, ok: bool, ttl: float = MAX_TTL, failures: int = 0) -> float:
    """When to resolve again: at the TTL after a success, with exponential backoff after failures."""
    if ok:
        return min(MAX_TTL, max(MIN_TTL, ttl))
    return min(MAX_BACKOFF, float(2 ** min(failures, 20)))


class Resolver:
    """A and AAAA lookups through dnspython, configured from `resolv_conf` at every lookup (a kubelet or an
    operator may rewrite it while the agent runs)."""

    def __init__(self, resolv_conf: str = "/etc/resolv.conf", *, port: int = 53):
        self.resolv_conf = resolv_conf
        self.port = port

    def _resolver(self):
        import dns.asyncresolver
        import dns.resolver

        try:
            r = dns.asyncresolver.Resolver(filename=self.resolv_conf)
        except dns.resolver.NoResolverConfiguration:
            # No file, or no nameserver in it: the C library's default, the local resolver.
            r = dns.asyncresolver.Resolver(configure=False)
            r.nameservers = ["127.0.0.1"]
        r.port = self.port
        # The answer is tried as written first when it has `ndots` dots, else after the search domains, as
        # the C library does (dnspython searches only when asked).
        r.use_search_by_default = True
        return r

    async def resolve(self, name: str) -> Answer:
        """A and AAAA records of name (v4 first, each sorted); raises DNSError when neither family has an
        address. Both families come from the same name of the search list (the first one that exists)."""
        import dns.exception
        import dns.resolver

        try:
            answers = await self._resolver().resolve_name(name)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            raise DNSError(f"no IPv4 or IPv6 addresses found for host: {name}") from None
        except dns.exception.DNSException as e:   # timeouts, SERVFAIL from every server, bad names ...
            raise DNSError(f"no answer for {name.rstrip('.')}: {e}") from None
        found: list[IP] = []
        ttls: list[float] = []
        for answer in answers.values():
            addrs = [ipaddress.ip_address(rr.address) for rr in (answer.rrset or ())]
            if addrs:
                found += sorted(set(addrs), key=str)
                # The smallest TTL along the CNAME chain: any link may change first.
                ttls.append(float(answer.chaining_result.minimum_ttl))
        if not found:
            raise DNSError(f"no IPv4 or IPv6 addresses found for host: {name}")
        found.sort(key=lambda ip: ip.version)   # stable: IPv4 first, each family sorted
        return Answer(tuple(found), min(ttls))


async def watch_name(name: str, resolver: "Resolver", on_answer, *, sleep=asyncio.sleep, log=None) -> None:
    """Resolve `name` forever: at the answer's TTL after a success, with backoff after failures.

    `on_answer(addresses, error)` is called after every attempt: with the addresses on success, and with
    `None` and the error text on failure, so that the caller keeps the last good addresses (a transient DNS
    failure must not tear down working rules).
    """
    failures = 0
    while True:
        try:
            answer = await resolver.resolve(name)
        except DNSError as e:
            delay = next_delay(ok=False, failures=failures)
            failures += 1
            if log is not None:
                log.warning("[unexpected] error resolving DNS name %s: %s (retrying in %gs)", name, e, delay)
            on_answer(None, str(e))
        else:
            failures = 0
            delay = next_delay(ok=True, ttl=answer.ttl)
            on_answer(answer.addresses, "")
        await sleep(delay)
