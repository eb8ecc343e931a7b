"""Placeholder replaced by the example user policy that mypy strict must accept."""
