"""Role settings: TOML < PDPS_* environment < flags, with clear errors on bad input."""

from __future__ import annotations

import pytest

from pdps.core.errors import ConfigError
from pdps.core.sgd import Mode
from pdps.shell.process import load_target
from pdps.shell.settings import BY_NAME, SETTINGS, job_config, resolve, role_env


def write(tmp_path, text: str) -> str:
    path = tmp_path / "pdps.toml"
    path.write_text(text)
    return str(path)


def test_precedence_file_then_env_then_flags(tmp_path):
    cfg = write(tmp_path, 'store = "etcd://file:1"\njob = "from-file"\nmode = "async"\npasses = 4\n[optimizer_args]\nlr = 0.5\n')
    env = {"PDPS_CONFIG": cfg, "PDPS_JOB": "from-env", "PDPS_PASSES": "7"}
    values = resolve("launch", {"passes": 9}, env)
    assert values["store"] == "etcd://file:1"  # file only
    assert values["job"] == "from-env"  # env beats file
    assert values["passes"] == 9  # flag beats env
    config = job_config(values)
    assert config.mode is Mode.ASYNC and config.optimizer_args == {"lr": 0.5} and config.name == "from-env"


def test_config_flag_beats_config_env(tmp_path):
    a = tmp_path / "a.toml"
    a.write_text('store = "redis://a:1/0"\n')
    b = tmp_path / "b.toml"
    b.write_text('store = "redis://b:1/0"\n')
    assert resolve("master", {"config": str(b)}, {"PDPS_CONFIG": str(a)})["store"] == "redis://b:1/0"


def test_job_defaults_sit_under_every_source(tmp_path):
    defaults = {"passes": 30, "optimizer": "Adam", "lr": 0.001}
    values = resolve("launch", {"store": "memory://", "lr": 0.1}, {"PDPS_PASSES": "2"}, defaults=defaults)
    config = job_config(values)
    assert (config.passes, config.optimizer, config.optimizer_args) == (2, "Adam", {"lr": 0.1})
    with pytest.raises(ConfigError, match="'listen'.*not a job setting"):
        resolve("launch", {"store": "memory://"}, {}, defaults={"listen": "x"})


def test_env_values_are_parsed_and_checked():
    values = resolve("launch", {}, {"PDPS_STORE": "memory://", "PDPS_TRAINERS": "3", "PDPS_JSON": "yes", "PDPS_STALENESS": "none", "PDPS_OPTIMIZER_ARGS": '{"lr": 0.2}'})
    assert values["trainers"] == 3 and values["json"] is True and values["staleness"] is None and values["optimizer_args"] == {"lr": 0.2}
    with pytest.raises(ConfigError, match="PDPS_TRAINERS: cannot read trainers from 'three'"):
        resolve("launch", {}, {"PDPS_STORE": "memory://", "PDPS_TRAINERS": "three"})
    with pytest.raises(ConfigError, match="mode must be one of sync, async.*PDPS_MODE"):
        resolve("launch", {}, {"PDPS_STORE": "memory://", "PDPS_MODE": "eventual"})
    with pytest.raises(ConfigError, match="expected a JSON object"):
        resolve("launch", {}, {"PDPS_STORE": "memory://", "PDPS_OPTIMIZER_ARGS": "[1]"})


def test_unknown_env_is_ignored_but_unknown_file_key_is_an_error(tmp_path, caplog):
    assert resolve("pserver", {}, {"PDPS_STORE": "memory://", "PDPS_STROE": "x"})["store"] == "memory://"
    assert "PDPS_STROE" in caplog.text
    cfg = write(tmp_path, 'store = "memory://"\nstroe = "x"\n')
    with pytest.raises(ConfigError, match=r"pdps.toml: unknown setting 'stroe'"):
        resolve("pserver", {"config": cfg}, {})


def test_a_shared_file_may_hold_other_commands_settings(tmp_path):
    cfg = write(tmp_path, 'store = "memory://"\nindex = 2\ntrainer_id = "t"\n')
    values = resolve("master", {"config": cfg}, {})
    assert "index" not in values and "trainer_id" not in values


@pytest.mark.parametrize(
    "line,expect",
    [
        ("grace = [1]", r"pdps.toml: grace must be a number, got \[1\] \(list\)"),
        ("grace = true", r"pdps.toml: grace must be a number, got True \(bool\)"),
        ("max_restarts = 2.5", r"pdps.toml: max_restarts must be a whole number, got 2.5 \(float\)"),
        ("json = 1", r"pdps.toml: json must be true or false, got 1 \(int\)"),
        ("job = 7", r"pdps.toml: job must be a string, got 7 \(int\)"),
        ("metrics_port = 70000", r"pdps.toml: metrics_port: cannot read metrics_port from '70000'"),
    ],
)
def test_a_role_setting_of_the_wrong_toml_type_is_refused(tmp_path, line, expect):
    cfg = write(tmp_path, f'store = "memory://"\n{line}\n')
    with pytest.raises(ConfigError, match=expect):
        resolve("launch", {"config": cfg}, {})


def test_role_settings_of_their_toml_type_pass(tmp_path):
    cfg = write(tmp_path, 'store = "memory://"\ngrace = 5\ntimeout = 2.5\nmax_restarts = 2\njson = true\nmetrics_port = 9100\n')
    values = resolve("launch", {"config": cfg}, {})
    assert (values["grace"], values["timeout"], values["max_restarts"], values["json"], values["metrics_port"]) == (5, 2.5, 2, True, 9100)


def test_log_level_is_read_in_any_case_from_a_file_as_from_the_environment(tmp_path):
    cfg = write(tmp_path, 'store = "memory://"\nlog_level = "debug"\n')
    assert resolve("master", {"config": cfg}, {})["log_level"] == "DEBUG"
    assert resolve("master", {}, {"PDPS_STORE": "memory://", "PDPS_LOG_LEVEL": "debug"})["log_level"] == "DEBUG"


@pytest.mark.parametrize(
    "command,name,value",
    [("launch", "timeout", -1.0), ("launch", "max_restarts", -1), ("master", "connect_timeout", float("nan")), ("pserver", "index", -2), ("trainer", "grace", -5.0)],
)
def test_a_negative_count_or_duration_of_a_role_is_refused(command, name, value):
    with pytest.raises(ConfigError, match=rf"{name} must be 0 or more, got {value!r}"):
        resolve(command, {"store": "memory://", name: value}, {})
    env = {"PDPS_STORE": "memory://", f"PDPS_{name.upper()}": str(value)}
    with pytest.raises(ConfigError, match=rf"{name} must be 0 or more"):
        resolve(command, {}, env)


def test_bad_files_and_missing_store(tmp_path):
    with pytest.raises(ConfigError, match="cannot read settings file"):
        resolve("master", {"config": str(tmp_path / "missing.toml")}, {})
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve("master", {"config": write(tmp_path, "store = \n")}, {})
    with pytest.raises(ConfigError, match="needs a coordination store"):
        resolve("master", {}, {})


def test_token_file(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    assert resolve("trainer", {"store": "memory://", "token_file": str(secret)}, {})["token"] == "s3cret"
    assert resolve("trainer", {"store": "memory://", "token_file": str(secret), "token": "flag"}, {})["token"] == "flag"
    secret.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        resolve("trainer", {"store": "memory://", "token_file": str(secret)}, {})


def test_role_env_hands_role_settings_to_children():
    values = resolve("launch", {"store": "etcd://h:1", "token": "t", "trainers": 4}, {})
    env = role_env(values)
    assert env["PDPS_STORE"] == "etcd://h:1" and env["PDPS_TOKEN"] == "t"
    assert "PDPS_TRAINERS" not in env and "PDPS_JSON" not in env  # the job lives in the store


def test_every_job_field_is_a_setting():
    import attrs

    from pdps.core.job import JobConfig

    fields = {a.name for a in attrs.fields(JobConfig)} - {"name"}
    assert fields <= {s.name for s in SETTINGS if s.job}
    assert len(BY_NAME) == len(SETTINGS)


def test_load_target_module_and_file(tmp_path):
    fn, module = load_target("pdps.examples.digits:train")
    assert fn.__name__ == "train" and hasattr(module, "evaluate")
    script = tmp_path / "my_train.py"
    script.write_text("def go(ctx):\n    return 42\n")
    fn, module = load_target(f"{script}:go")
    assert fn(None) == 42
    assert load_target(f"{script}:go")[1] is module  # executed once, like an import
    for bad, msg in [
        ("nocolon", "must look like"),
        ("pdps.examples.digits:nope", "has no function 'nope'"),
        ("no_such_module_xyz:f", "cannot import"),
        (f"{tmp_path}/missing.py:f", "no file"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            load_target(bad)


def test_connection_limits_reach_the_grpc_transport_and_the_launchers_children():
    from pdps.shell.process import open_role_transport

    flags = {"store": "memory://", "handshake_timeout": 2.5, "idle_timeout": 30.0, "max_connections": 8, "max_streams": 4}
    transport = open_role_transport(resolve("pserver", flags, {}))
    assert (transport.handshake_timeout, transport.idle_timeout, transport.max_connections, transport.max_streams) == (2.5, 30.0, 8, 4)
    trainer = open_role_transport(resolve("trainer", {"store": "memory://"}, {"PDPS_IDLE_TIMEOUT": "30", "PDPS_MAX_STREAMS": "4"}))
    assert trainer.idle_timeout == 30.0 and trainer.max_streams == 100  # a trainer serves nothing: only its pool's idle time
    env = role_env(resolve("launch", flags, {}))
    assert (env["PDPS_HANDSHAKE_TIMEOUT"], env["PDPS_IDLE_TIMEOUT"], env["PDPS_MAX_CONNECTIONS"], env["PDPS_MAX_STREAMS"]) == ("2.5", "30.0", "8", "4")
    from pdps.adapters.grpc_transport import GrpcTransport

    defaults, built_in = open_role_transport(resolve("pserver", {"store": "memory://"}, {})), GrpcTransport()
    for name in ("handshake_timeout", "idle_timeout", "max_connections", "max_streams"):
        assert getattr(defaults, name) == getattr(built_in, name), name  # one default, stated twice
    with pytest.raises(ConfigError, match="max_connections=0"):
        open_role_transport(resolve("master", {"store": "memory://", "max_connections": 0}, {}))
