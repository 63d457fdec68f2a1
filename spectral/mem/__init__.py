"""Memory: the token-slot allocator, the KV pool, the request-to-token table, the radix cache."""
