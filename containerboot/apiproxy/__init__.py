"""The API server proxy: kubectl over the tailnet, with tailnet identities mapped to Kubernetes ones.

`identity` is the pure core (WhoIs answer + grants → impersonation, request headers → forwarded headers);
`server` is the HTTP proxy (h11 on both sides, upgrades piped as bytes); `run` is the entrypoint that waits
for tailscaled, chooses HTTP or HTTPS and serves on the node's tailnet addresses.
"""
