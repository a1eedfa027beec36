"""The serve-config path's status, as the agent reports it (pure data).

It lives with the serve path that fills it; `containerboot.status.AgentStatus` embeds it and judges readiness
from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ServeStatus"]


@dataclass(frozen=True)
class ServeStatus:
    """State of the serve config path (only present when TS_SERVE_CONFIG is set)."""

    applied: bool = False              # the desired (or last good) config is in force in tailscaled
    last_error: str = ""               # e.g. the validation error of a bad file; the last good config stays
    cert_required: bool = False        # the config has HTTPS / TerminateTLS endpoints
    cert_ready: bool = False           # every needed certificate has been obtained
    https_endpoint: str = ""           # cert domain or "no-https" ("" before the first config)
    advertised: tuple[str, ...] = ()   # Tailscale Services currently advertised by the agent

    def to_json(self) -> dict[str, Any]:
        return {"applied": self.applied, "last_error": self.last_error, "cert_required": self.cert_required,
                "cert_ready": self.cert_ready, "https_endpoint": self.https_endpoint,
                "advertised": list(self.advertised)}
