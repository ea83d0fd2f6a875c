"""Runnable examples; ``pdps.examples.digits:train`` is the demo's training function."""
