"""Training EAGLE-3 draft heads (`spectral train-eagle3`): data from the target, the
training-time-test loss, the teacher store. Serving never imports it."""
