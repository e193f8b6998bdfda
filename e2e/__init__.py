"""End-to-end suites: the local control plane (default), kind (with Docker), a GPU cluster."""
