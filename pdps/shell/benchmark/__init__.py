"""``pdps bench``: run the programs in the checkout's ``bench/``, check the targets, write the report.

* :mod:`pdps.shell.benchmark.targets` — the one table of performance targets, how each
  figure is read from a suite's JSON, and their evaluation (MET / MISSED, the
  stability of two consecutive runs). No I/O.
* :mod:`pdps.shell.benchmark.suites` — which program each suite is, with which arguments
  (full and ``--quick``), and running it as a subprocess.
* :mod:`pdps.shell.benchmark.report` — the results JSON, ``docs/performance.md`` and the
  ``--check`` lines, all from the same results dict.
* :mod:`pdps.shell.benchmark.curves` — the scale suite's costs against its sizes, and the
  slope of each on log-log: flat, linear or worse. No I/O.
* :mod:`pdps.shell.benchmark.plots` — the PNG plots (matplotlib, the ``bench`` extra).
* :mod:`pdps.shell.benchmark.runner` — the command itself: runs the suites, writes the lot.

Nothing here is imported by ``import pdps``; matplotlib is imported only to draw.
"""
