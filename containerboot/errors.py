"""The agent's fatal error, shared by the lifecycle's parts (boot, login, steady state) and the agent itself."""
from __future__ import annotations


class AgentError(Exception):
    """A fatal error: logged once and the agent exits 1 after an orderly shutdown."""
