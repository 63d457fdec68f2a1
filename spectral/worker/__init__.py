"""The model worker: owns weights, KV tensors and sampling."""
