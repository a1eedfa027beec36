"""containerboot: the agent that runs as the entrypoint of a Tailscale proxy Pod."""
