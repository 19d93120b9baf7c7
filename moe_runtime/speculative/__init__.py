"""Speculative decoding: drafts proposed on the host (n-gram) or by the checkpoint's MTP layer, verified by one
target forward, greedily or by speculative sampling (docs/design.md, "Speculative decoding")."""
