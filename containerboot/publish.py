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

from .errors import AgentError
from .settings import Settings
from .state import NodeState

if TYPE_CHECKING:
    from .kube.state import SecretState
    from .proxyservices import ServicesDesired


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

    async def after_pass(self, node: NodeState, *, routed: bool, services: "ServicesDesired | None",
                         services_in: bool, capver: int) -> None:
        """What a reconcile pass lets the agent publish: the FQDN and IPs only once traffic can flow (`routed`;
        the operator reads them as "this proxy works"), the per-service records only once their rules are in
        (`services_in`; the operator routes a service to this Pod when the record matches what it asked for)."""
        if routed:
            await self.device_endpoints(node, capver)
        if services is not None and services_in:
            await self.service_records(services.egress_status, services.ingress_status)

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


async def connect(s: Settings, env: Mapping[str, str], deadline: float, *,
                  config_authkey: str = "") -> tuple[NullPublisher, str]:
    """The publisher for this configuration, after the state Secret's boot set-up (RBAC, the auth key it may
    hold, the reset of the previous run's keys); and the auth key found in the Secret ("" when none)."""
    if not s.kube_secret:
        return NullPublisher(), ""
    from .kube.client import KubeClient, KubeError
    from .kube.state import KubeSetupError, SecretState
    try:
        client = KubeClient.from_environment(env, root=s.root, url=s.kube_api_url)
    except KubeError as e:
        raise AgentError(f"error initializing kube client: {e}") from None
    secret = SecretState(client, s.kube_secret)
    try:
        setup = await secret.setup(s, deadline, config_authkey=config_authkey)
    except BaseException as e:
        await client.aclose()
        if isinstance(e, KubeSetupError):
            raise AgentError(str(e)) from None
        raise
    publisher = SecretPublisher(secret) if setup.has_state_store else UnwritableSecret(secret)
    return publisher, setup.authkey_from_secret
