"""``pdps ... --help`` and argument errors: fast (torch is never imported) and truthful."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

COMMANDS = [
    [],
    ["demo"],
    ["launch"],
    ["master"],
    ["pserver"],
    ["trainer"],
    ["status"],
    ["checkpoint"],
    ["checkpoint", "list"],
    ["checkpoint", "inspect"],
    ["checkpoint", "restore"],
    ["bench"],
]

ARGUMENT_ERRORS = [
    ["demo", "--trainers", "x"],
    ["status", "memory://", "--pass", "-1"],
    ["launch", "--trainers", "3"],  # no --store, no TARGET
    ["trainer", "--store", "etcd://127.0.0.1:1"],  # no TARGET
    ["status"],  # no store
    ["checkpoint", "inspect"],  # no store
    ["bench", "--runs", "0"],
]

# Runs the CLI's main in a fresh interpreter and reports what it printed and whether torch was loaded.
PROBE = """
import contextlib, io, json, sys
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        from pdps.shell.cli import main
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
print(json.dumps({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "torch": "torch" in sys.modules}))
"""


def _clean_env() -> dict[str, str]:
    """This process's environment without PDPS_* variables (they change what is required)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PDPS_")}


def probe(*args: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120, env=env or _clean_env()
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "pdps")
def test_help_does_not_import_torch_and_shows_no_empty_default(command):
    result = probe(*command, "--help")
    assert result["code"] == 0, result["stderr"]
    assert result["stdout"].startswith("usage: pdps"), result["stdout"]
    assert not result["torch"], f"pdps {' '.join(command)} --help imported torch"
    assert "(default: None)" not in result["stdout"]
    assert "(default: )" not in result["stdout"]


@pytest.mark.parametrize("args", ARGUMENT_ERRORS, ids=" ".join)
def test_argument_errors_do_not_import_torch(args):
    result = probe(*args)
    assert result["code"] == 2, result
    assert "error:" in result["stderr"] and "Traceback" not in result["stderr"]
    assert not result["torch"], f"pdps {' '.join(args)} imported torch"


def _usage(help_text: str) -> str:
    return help_text.split("\n\n", 1)[0]


@pytest.mark.parametrize("command", ["launch", "trainer"])
def test_store_and_target_show_as_required(command):
    usage = _usage(probe(command, "--help")["stdout"])
    assert re.search(r"(?<!\[)--store STORE(?!\])", usage), usage
    assert re.search(r"(?<!\[)TARGET(?!\])", usage), usage
    result = probe(command)
    assert result["code"] == 2
    assert "the following arguments are required: --store, TARGET" in result["stderr"]


@pytest.mark.parametrize("command", ["master", "pserver"])
def test_store_shows_as_required_for_the_other_roles(command):
    usage = _usage(probe(command, "--help")["stdout"])
    assert re.search(r"(?<!\[)--store STORE(?!\])", usage), usage


def test_store_and_target_may_come_from_the_environment_or_a_settings_file(tmp_path):
    env = {**_clean_env(), "PDPS_STORE": "etcd://127.0.0.1:1", "PDPS_TARGET": "pkg:train"}
    usage = _usage(probe("launch", "--help", env=env)["stdout"])
    assert "[--store STORE]" in usage and "[TARGET]" in usage, usage
    settings = tmp_path / "pdps.toml"
    settings.write_text('store = "etcd://127.0.0.1:1"\n')
    usage = _usage(probe("trainer", "--config", str(settings), "--help")["stdout"])
    assert "[--store STORE]" in usage, usage
    # a settings file without the store: the error names every place it may come from
    result = probe("pserver", "--config", str(tmp_path / "pdps.toml"), "--store", "")
    assert result["code"] == 2 and "needs a coordination store" in result["stderr"], result


@pytest.mark.parametrize(
    "args,expect",
    [
        (["master", "--store", "memory://"], "store memory:// is in this process's memory, where no other role can find this master"),
        (["trainer", "--store", "memory://x", "pkg:train"], "no other role can find this trainer"),
        (["pserver", "--store", "etcd://127.0.0.1:1", "--transport", "inproc"], "pdps pserver runs one role, in a process of its own, and transport inproc"),
    ],
)
def test_a_role_process_nobody_could_reach_is_refused_at_once(args, expect):
    """inproc and memory:// live in one process: a role started with them waited for
    peers that could never find it (the setting says: launch only)."""
    result = probe(*args)
    assert result["code"] == 2 and expect in result["stderr"] and result["stderr"].startswith("pdps: error: "), result


@pytest.mark.parametrize(
    "args,expect",
    [
        (["launch", "--store", "etcd://127.0.0.1:1", "--optimizer-args", "{bad", "pkg:train"], "argument --optimizer-args: cannot read optimizer_args from '{bad'"),
        (["master", "--store", "etcd://127.0.0.1:1", "--metrics-port", "70000"], "argument --metrics-port: cannot read metrics_port from '70000': a port is 0 to 65535"),
        (["launch", "--store", "etcd://127.0.0.1:1", "--trainers", "3.0", "pkg:train"], "argument --trainers: cannot read trainers from '3.0'"),
    ],
)
def test_a_flag_value_that_cannot_be_read_names_the_setting_as_its_variable_would(args, expect):
    result = probe(*args)
    assert result["code"] == 2 and expect in result["stderr"] and not result["torch"], result


@pytest.mark.parametrize(
    "args",
    [
        ["status", "etcd://127.0.0.1:1", "--connect-timeout", "-1"],
        ["checkpoint", "list", "etcd://127.0.0.1:1", "--connect-timeout", "nan"],
        ["scale", "etcd://127.0.0.1:1", "--pservers", "3", "--wait", "--timeout", "-5"],
    ],
    ids=" ".join,
)
def test_seconds_below_0_are_refused_by_the_store_commands_as_by_the_roles(args):
    """A negative --connect-timeout was taken as "give up at once" (the role commands
    refuse it: operations.md); now status, checkpoint and scale refuse it too, before
    reaching for the store."""
    result = probe(*args)
    assert result["code"] == 2 and "seconds must be 0 or more" in result["stderr"] and not result["torch"], result
