"""Runnable examples; ``pdps.examples.digits:train`` is the demo's training function,
``pdps.examples.ctr`` the click-prediction example of sparse embedding tables."""
