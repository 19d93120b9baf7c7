"""KV cache tiers below the device pool: host memory and disk, behind one connector Protocol (docs/design.md)."""
