"""The scheduler: requests, batches, admission and the step loop."""
