"""The shell's shared machinery: effectful helpers that roles and adapters both use.

* :mod:`pdps.runtime.retry` — the one retry loop (pausing by :class:`pdps.core.backoff.Backoff`);
* :mod:`pdps.runtime.cas` — the one compare-and-set loop, applying pure decisions
  (:mod:`pdps.core.txn`) to a store;
* :mod:`pdps.runtime.resilient` — riding out store outages;
* :mod:`pdps.runtime.lease` — keeping a lease alive on a thread;
* :mod:`pdps.runtime.rounds` — reading a sync round (its contributions and close marker) back;
* :mod:`pdps.runtime.counting` — a store that counts what is asked of it (the scale benchmark's meter).

It imports the core and the ports only: never an adapter, a role, the registry or torch.
"""
