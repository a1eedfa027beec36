"""netfilter: the agent's firewall and routing, as a desired state applied in one transaction."""
