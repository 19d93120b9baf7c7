"""Keys and socket hardening shared by the control plane and the KV transfer: the control key, the transfer
key, reading a shared secret, and what every CURVE socket sets."""
