"""The nouns every layer shares: requests, what the scheduler and worker exchange, forwards."""
