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


def test_runtime_imports_only_core_ports_and_itself():
    """pdps.runtime is the machinery roles and adapters share: it may use neither."""
    for path in sorted((PKG / "runtime").glob("*.py")):
        for name in imports_of(path):
            top = name.split(".")[0]
            if top == "pdps":
                assert name.startswith(("pdps.core", "pdps.ports", "pdps.runtime")), f"runtime/{path.name} imports {name}"
            else:
                assert top in sys.stdlib_module_names, f"runtime/{path.name} imports {name}"


def test_nothing_below_the_shell_imports_it():
    for path in sorted(PKG.rglob("*.py")):
        if PKG / "shell" in path.parents or path.parent == PKG:
            continue
        for name in imports_of(path):
            assert not name.startswith("pdps.shell"), f"{path.relative_to(PKG)} imports {name}: the shell is the outermost layer"


def every_import(path: Path) -> set[str]:
    """Every module a file imports, at any level (inside functions too), relative
    imports made absolute; ``from a import b`` counts ``a`` and ``a.b`` (b may be a module)."""
    package = ["pdps", *path.relative_to(PKG).parent.parts]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) if node.level else node.module
            assert base, f"{path}: {ast.dump(node)}"
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_roles_import_no_adapter_registry_or_torch():
    """Roles drive ports: the composition roots choose the adapters (through the
    registry) and hand them in, and tensors are the compute port's business. No import
    of an adapter, the registry or torch anywhere in roles/, inside functions too."""
    checked = 0
    for path in sorted((PKG / "roles").rglob("*.py")):
        rel = path.relative_to(PKG / "roles").as_posix()
        banned = ("pdps.adapters", "pdps.registry", "torch")
        for name in every_import(path):
            assert not any(name == b or name.startswith(b + ".") for b in banned), f"roles/{rel} imports {name}: roles use ports only"
        checked += 1
    assert checked >= 3  # master, pserver, the trainer


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


def imported_on_load(path: Path) -> set[str]:
    """What loading the module imports at once: its top-level imports (in ``if`` and
    ``try`` blocks too), not those inside functions or under ``if TYPE_CHECKING``.
    ``from a import b`` counts ``a`` and ``a.b`` (b may be a module)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(ast.parse(path.read_text()).body)
    return names


def source_of(module: str) -> Path | None:
    parts = module.split(".")[1:]
    if not parts:
        return None  # the package root
    for path in (PKG.joinpath(*parts[:-1], parts[-1] + ".py"), PKG.joinpath(*parts, "__init__.py")):
        if path.is_file():
            return path
    return None  # a name imported from a module


def test_the_master_and_status_load_without_torch():
    """``pdps master`` computes nothing and ``pdps status`` only reads the store: the
    modules they run import torch nowhere on load (every multi-process job starts a
    master, and torch takes a second or two of CPU to import). The package root is
    left out: what ``import pdps`` loads is test_import_pdps_needs_only_the_core_dependencies's."""
    for root in ("pdps.shell.process", "pdps.roles.master", "pdps.shell.status"):
        via: dict[str, str | None] = {root: None}  # module -> the module that loads it
        todo = [root]
        while todo:
            module = todo.pop()
            parts = module.split(".")
            path = source_of(module)
            found = [".".join(parts[:i]) for i in range(2, len(parts))]  # parent packages load first
            if path is not None:
                found += [name for name in imported_on_load(path) if name.split(".")[0] in ("pdps", "torch")]
            for name in found:
                if name not in via:
                    via[name] = module
                    todo.append(name)
        torch = next((m for m in via if m.split(".")[0] == "torch"), None)
        chain = [torch]
        while chain[-1] is not None and via[chain[-1]] is not None:
            chain.append(via[chain[-1]])
        assert torch is None, f"{root} loads torch: {' <- '.join(chain)}"
