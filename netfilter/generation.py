"""The kernel's nftables ruleset generation: the cheap test that nobody changed any netfilter rules.

Every committed nf_tables transaction in a network namespace (nft, libnftables, iptables-nft, whoever makes
it) increases one counter, which `NFT_MSG_GETGEN` reads in one netlink round trip (tens of microseconds,
whatever the size of the rules). The backends keep the rule set they applied last and the generation their
own commit left; while the generation is unchanged the kernel still holds exactly those rules, so a change can
be applied as a delta, and a foreign change (a different generation) sends them back to listing and comparing.
The iptables-legacy flavour writes x_tables, which has no such counter.
"""
from __future__ import annotations

import socket
import struct
import threading

_NETLINK_NETFILTER = 12
_NFT_MSG_GETGEN = (10 << 8) | 16        # NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETGEN
_NFT_MSG_NEWGEN = (10 << 8) | 15        # ... | NFT_MSG_NEWGEN: the reply
_NFTA_GEN_ID = 1


def parse_generation(reply: bytes) -> int | None:
    """NFTA_GEN_ID of a NEWGEN netlink reply, None for anything else (an error reply, a short read)."""
    if len(reply) < 20:
        return None
    _length, mtype, _flags, _seq, _pid = struct.unpack_from("=IHHII", reply)
    if mtype != _NFT_MSG_NEWGEN:
        return None
    off = 20        # netlink header (16) + nfgenmsg (4)
    while off + 4 <= len(reply):
        alen, atype = struct.unpack_from("=HH", reply, off)
        if alen < 4:
            break
        if atype & 0x3FFF == _NFTA_GEN_ID and alen >= 8:
            return int(struct.unpack_from(">I", reply, off + 4)[0])
        off += (alen + 3) & ~3
    return None


def advanced_by(before: int | None, after: int | None, commits: int) -> bool:
    """Whether the generation went from `before` to `after` by exactly `commits` transactions (it wraps)."""
    return before is not None and after is not None and after == (before + commits) % 2**32


class RulesetGeneration:
    """Reads the generation of the network namespace this object was made in; `read()` is None where the
    kernel or the sandbox does not allow it (then the backends always list and compare)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        try:
            self._sock: socket.socket | None = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW,
                                                             _NETLINK_NETFILTER)
        except OSError:
            self._sock = None

    def read(self) -> int | None:
        if self._sock is None:
            return None
        request = struct.pack("=IHHII", 20, _NFT_MSG_GETGEN, 1, 0, 0) + struct.pack("=BBH", 0, 0, 0)
        with self._lock:
            try:
                self._sock.send(request)
                return parse_generation(self._sock.recv(4096))
            except OSError:
                return None
