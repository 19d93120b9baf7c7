"""Speculative decoding: drafts proposed on the host, verified by one target forward (docs/design.md,
"Speculative decoding")."""
