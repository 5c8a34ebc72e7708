"""Symmetric workspaces (userbuffers): every rank of a group maps every peer's buffer."""
