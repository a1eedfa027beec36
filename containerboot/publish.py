"""What the agent publishes in its state Secret, and when: one object for the whole policy.

`SecretPublisher` writes the agent's keys (device ID before any rule, FQDN and IPs once traffic can flow, the
per-service records once their rules are in, the HTTPS endpoint, the auth key's removal after a TS_AUTH_ONCE
login, the consistency wait at shutdown). `NullPublisher` is the same policy without a Secret to write to (no
TS_KUBE_SECRET, outside Kubernetes, or no patch permission): every write is a no-op and start-up never waits
for one. The agent holds exactly one of the two, so no caller asks "is there a Secret" itself. The key names
and values come from the pure `kube.secretstate`.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Mapping

from .state import NodeState

if TYPE_CHECKING:
    from .kube.state import SecretState


class NullPublisher:
    """No Secret: nothing is published, and nothing waits for it."""

    #: The Secret's adapter when a state Secret exists, even one the agent may not patch (the reissue flow and
    #: the early-rules decision need to know); None without one.
    secret: "SecretState | None" = None
    #: The agent manages its keys of the Secret (in Kubernetes, patch allowed).
    manages_keys = False

    async def device_id(self, node: NodeState) -> None:
        """Before any rule: the device ID, so that the operator can always clean the device up."""

    async def device_endpoints(self, node: NodeState, capver: int) -> None:
        """Once traffic can flow: the FQDN and the IPs (the operator reads them as "this proxy works")."""

    async def service_records(self, egress: bytes | None, ingress: bytes | None) -> None:
        """Once their rules are in: the ProxyGroup's per-service records."""

    async def https_endpoint(self, endpoint: str) -> None:
        """The serve config's HTTPS endpoint (or "no-https")."""

    def device_published(self) -> bool:
        """Whether "Startup complete" may be reported: the device keys are in (always, without a Secret)."""
        return True

    async def delete_authkey(self) -> None:
        """After a TS_AUTH_ONCE login: the key has done its job."""

    async def settle(self, deadline: float) -> None:
        """Before tailscaled is stopped: let it finish writing its own state to the Secret."""

    async def aclose(self) -> None:
        if self.secret is not None:
            await self.secret.client.aclose()


class UnwritableSecret(NullPublisher):
    """A state Secret the agent may read but not manage (no patch permission, or not in Kubernetes)."""

    def __init__(self, secret: "SecretState") -> None:
        self.secret = secret


class SecretPublisher(NullPublisher):
    """The agent manages its keys of the state Secret (in Kubernetes, patch allowed)."""

    manages_keys = True

    def __init__(self, secret: "SecretState") -> None:
        self.secret = secret
        self._state = secret

    async def device_id(self, node: NodeState) -> None:
        from .kube import secretstate as ss
        me = node.self_node
        if me is not None and me.stable_id:
            # A login that got this far worked: the reissue rate limit starts over.
            await self._state.sync({**ss.device_id_patch(me), **ss.reissue_reset_patch()})

    async def device_endpoints(self, node: NodeState, capver: int) -> None:
        from .kube import secretstate as ss
        me = node.self_node
        if me is None:
            return
        want: dict[str, bytes | None] = {**ss.device_endpoints_patch(me.name, me.ips)}
        if capver:
            want[ss.KEY_CAPVER] = str(capver).encode()
        await self._state.sync(want)

    async def service_records(self, egress: bytes | None, ingress: bytes | None) -> None:
        from .kube import secretstate as ss
        status: Mapping[str, bytes | None] = {
            **({ss.KEY_EGRESS_SERVICES: egress} if egress is not None else {}),
            **({ss.KEY_INGRESS_CONFIG: ingress} if ingress is not None else {})}
        await self._state.sync(status)

    async def https_endpoint(self, endpoint: str) -> None:
        from .kube import secretstate as ss
        await self._state.sync(ss.https_endpoint_patch(endpoint))

    def device_published(self) -> bool:
        return self._state.has_written("device_id", "device_fqdn")

    async def delete_authkey(self) -> None:
        await self._state.delete_authkey(time.monotonic() + 30)

    async def settle(self, deadline: float) -> None:
        await self._state.wait_consistent(deadline)


Publisher = NullPublisher   # the interface: NullPublisher's methods, overridden by the Secret's publishers
