"""The local control plane: `python -m e2e.cluster up|down|env|status|restart COMPONENT`."""
