"""Scheduler-side sources of draft trees (n-gram, LOOKAHEAD, grammar-forced text), the round
that plans and takes them, and the planner with its acceptance statistics."""
