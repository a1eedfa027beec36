"""labtools: a local tailnet in network namespaces (headscale + real tailscaled), for the demo and the netns tests."""
