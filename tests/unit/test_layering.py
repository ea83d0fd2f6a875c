"""The house rules of the layout: a pure core, and ``import pdps`` on core dependencies."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pdps"
ALLOWED_IN_CORE = {"attrs", "numpy"} | set(sys.stdlib_module_names)
IO_IN_STDLIB = {"socket", "threading", "subprocess", "asyncio", "os", "io", "time", "random", "multiprocessing", "logging"}


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_core_imports_only_stdlib_attrs_numpy_and_itself():
    for path in sorted((PKG / "core").glob("*.py")):
        for name in imports_of(path):
            top = name.split(".")[0]
            if top == "pdps":
                assert name.startswith("pdps.core"), f"{path.name} imports {name}: the core imports only the core"
            else:
                assert top in ALLOWED_IN_CORE, f"{path.name} imports {name}"
                assert top not in IO_IN_STDLIB, f"{path.name} imports {name}: the core does no I/O and reads no clock"


def test_ports_import_no_adapter_or_role():
    for path in sorted((PKG / "ports").glob("*.py")):
        for name in imports_of(path):
            assert not name.startswith(("pdps.adapters", "pdps.roles")), f"ports/{path.name} imports {name}"


def test_roles_import_no_adapter_at_module_level():
    for path in sorted((PKG / "roles").glob("*.py")):
        for name in imports_of(path):
            assert not name.startswith("pdps.adapters"), f"roles/{path.name} imports {name}: roles use ports only"


def test_import_pdps_needs_only_the_core_dependencies():
    blocked = ["pyarrow", "sklearn", "grpc", "redis", "pyetcd", "s3fs", "boto3"]
    code = (
        "import sys\n"
        f"for m in {blocked!r}: sys.modules[m] = None\n"
        "import pdps\n"
        "assert pdps.simulate and pdps.TrainerContext\n"
        f"assert not any(m in sys.modules and sys.modules[m] is not None for m in {blocked!r})\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_missing_extra_is_named():
    code = (
        "import sys\nsys.modules['pyarrow'] = None\n"
        "import pdps\n"
        "try:\n    pdps.open_data_source('/tmp/x').tasks()\n"
        "except pdps.MissingExtraError as e:\n    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'pdps[parquet]'" in proc.stdout, proc.stdout + proc.stderr
