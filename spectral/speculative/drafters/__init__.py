"""Worker-side drafters: each one module behind the `Drafter` protocol (base.py), built by
name through speculative.registry."""
