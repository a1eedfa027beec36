"""The error every firewall backend raises; a module of its own so that backends and callers share it without
importing each other."""
from __future__ import annotations


class FirewallError(Exception):
    """A firewall operation failed; str(e) says what was attempted, what the kernel/tool said, and a fix."""
