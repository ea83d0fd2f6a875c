"""A master never loads torch: its calls carry no tensors, and the gRPC transport
imports torch at its first tensor (a master process: about 110 MB resident instead of
290, and 1-2 s less to start)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from pdps.adapters.grpc_transport import GrpcTransport
from pdps.ports.transport import Message
import pdps.roles.master, pdps.shell.cli, pdps.registry
t = GrpcTransport()
ep = t.serve("grpc://127.0.0.1:0", {"get_task": lambda m: Message({"task": m.meta["n"] + 1})})
ch = t.connect(ep.address)
assert ch.call("get_task", Message({"n": 1}), timeout=30).meta == {"task": 2}
print("torch" in sys.modules)
import torch
reply = ch.call("get_task", Message({"n": 2}, [torch.ones(3)]), timeout=30)  # tensors still travel once torch is in
print(reply.meta["task"])
ch.close()
ep.close()
"""


def test_the_master_side_of_the_grpc_transport_does_not_import_torch():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "3"], proc.stdout


def test_the_wire_dtypes_are_all_there_when_asked_for_before_any_tensor():
    script = "from pdps.adapters import grpc_transport as gt; d = gt.dtypes(); print(len(d), 'float32' in d, 'bfloat16' in d)"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    count, *found = proc.stdout.split()
    assert int(count) > 10 and found == ["True", "True"], proc.stdout
