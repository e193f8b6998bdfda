"""Pytest plugins shared by every suite (the local control plane fixtures live in e2e/fixtures.py)."""

pytest_plugins = ["e2e.fixtures"]
