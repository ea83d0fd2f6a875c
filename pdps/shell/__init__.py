"""The shell: the composition roots and the command line.

Everything here wires adapters to roles and talks to the user; nothing below imports it.

* :mod:`pdps.shell.sim` — ``simulate``: a whole job in one process;
* :mod:`pdps.shell.process` — one role as an operating-system process;
* :mod:`pdps.shell.launch` — ``pdps launch``: a job's processes on this machine;
* :mod:`pdps.shell.cli` — the ``pdps`` command;
* :mod:`pdps.shell.status`, :mod:`pdps.shell.checkpoint_cli` — ``pdps status`` and
  ``pdps checkpoint``;
* :mod:`pdps.shell.settings` — settings from flags, environment and files;
* :mod:`pdps.shell.benchmark` — ``pdps bench``.
"""
