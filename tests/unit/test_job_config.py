"""Settings are checked where they enter: ``JobConfig(...)`` and ``pdps.simulate(...)``.

A wrong type, a value out of range or a misspelt name is a ``ConfigError`` naming the
setting, the value and what was expected, raised before anything starts.
"""

from __future__ import annotations

import pytest

import pdps
from pdps.core.job import JobConfig


def _train(ctx):  # never runs: every call below is refused first
    raise AssertionError("a refused job ran")


@pytest.mark.parametrize(
    "settings,expect",
    [
        ({"trainers": "3"}, r"trainers must be a whole number >= 1, got '3' \(str\)"),
        ({"trainers": 2.5}, r"trainers must be a whole number >= 1, got 2.5 \(float\)"),
        ({"trainers": 3.0}, r"trainers must be a whole number >= 1, got 3.0 \(float\)"),
        ({"trainers": True}, r"trainers must be a whole number >= 1, got True \(bool\)"),
        ({"pservers": 0}, r"pservers must be a whole number >= 1, got 0"),
        ({"batch_size": None}, r"batch_size must be a whole number >= 1, got None"),
        ({"failure_max": -1}, r"failure_max must be a whole number >= 0, got -1"),
        ({"failure_max": "3"}, r"failure_max must be a whole number >= 0, got '3' \(str\)"),
        ({"mode": "async", "staleness": "4"}, r"staleness must be a whole number >= 0 or None, got '4' \(str\)"),
        ({"checkpoint_every": 1.5}, r"checkpoint_every must be a whole number >= 0, got 1.5"),
        ({"task_timeout": "60"}, r"task_timeout must be a number of seconds > 0, got '60' \(str\)"),
        ({"lease_ttl": True}, r"lease_ttl must be a number of seconds > 0, got True \(bool\)"),
        ({"lease_ttl": float("nan")}, r"lease_ttl must be a number of seconds > 0, got nan"),
        ({"checkpoint_seconds": -1.0}, r"checkpoint_seconds must be a number of seconds >= 0, got -1.0"),
        ({"optimizer": 3}, r"optimizer must be a string, got 3 \(int\)"),
        ({"dataset": None}, r"dataset must be a string, got None"),
        ({"name": 7}, r"name must be a string, got 7 \(int\)"),
        ({"overlap": True}, r"overlap must be a string, got True \(bool\)"),
        ({"optimizer_args": 0.1}, r"optimizer_args must be a dict of the optimizer's keyword arguments, got 0.1 \(float\)"),
        ({"optimizer_args": [("lr", 0.1)]}, r"optimizer_args must be a dict"),
        ({"mode": 1}, r"mode must be 'sync' or 'async', got 1"),
        ({"speculation": "yes"}, r"speculation must be True or False, got 'yes' \(str\)"),
        ({"speculation": 1}, r"speculation must be True or False, got 1 \(int\)"),
        ({"sparse_optimizer": None}, r"sparse_optimizer must be a string, got None"),
    ],
)
def test_a_wrong_type_or_range_is_a_config_error_naming_setting_value_and_expectation(settings, expect):
    with pytest.raises(pdps.ConfigError, match=expect):
        JobConfig(**settings)


@pytest.mark.parametrize(
    "settings,expect",
    [
        ({"trainer": 3}, r"unknown setting trainer=3; did you mean 'trainers'\?"),
        ({"batchsize": 8}, r"unknown setting batchsize=8; did you mean 'batch_size'\?"),
        ({"lr": 0.1}, r"unknown setting lr=0.1; an optimizer's arguments go in optimizer_args, e.g. optimizer_args=\{'lr': 0.1\}"),
        ({"colour": "red"}, r"unknown setting colour='red'; the settings are: batch_size, before_job, checkpoint_every"),
    ],
)
def test_an_unknown_setting_is_a_config_error_with_a_suggestion(settings, expect):
    with pytest.raises(pdps.ConfigError, match=expect):
        JobConfig(**settings)


def test_sound_settings_pass_and_numbers_of_seconds_may_be_whole():
    config = JobConfig(trainers=3, lease_ttl=2, task_timeout=60, mode="async", staleness=0, optimizer_args={"lr": 1})
    assert (config.trainers, config.lease_ttl, config.staleness) == (3, 2, 0)
    assert JobConfig.decode(config.encode()) == config
    assert JobConfig.from_json(config.to_json()) == config


def test_from_json_suggests_too():
    with pytest.raises(pdps.ConfigError, match=r"unknown setting pserver=2; did you mean 'pservers'\?"):
        JobConfig.from_json({"pserver": 2})


@pytest.mark.parametrize(
    "kwargs,expect",
    [
        ({"trainers": "3"}, r"trainers must be a whole number >= 1, got '3' \(str\)"),
        ({"trainers": 2.5}, r"trainers must be a whole number >= 1, got 2.5 \(float\)"),
        ({"lr": 0.1}, r"unknown setting lr=0.1; an optimizer's arguments go in optimizer_args"),
        ({"trainrs": 2}, r"did you mean 'trainers'\?"),
        ({"kill": [0]}, r"kill must be a dict of trainer index -> steps, got \[0\] \(list\)"),
        ({"kill": {"0": 1}}, r"kill must be a dict of trainer index -> steps: trainer index '0' \(str\) is not a whole number"),
        ({"kill": {0: -1}}, r"kill\[0\] must be a whole number >= 0, got -1"),
        ({"kill": {0: 1.5}}, r"kill\[0\] must be a whole number >= 0, got 1.5"),
        ({"kill": {3: 1}}, r"kill names trainers \[3\], but the job has trainers 0..0"),
        ({"timeout": "10"}, r"timeout must be a number of seconds > 0, got '10' \(str\)"),
        ({"timeout": 0}, r"timeout must be a number of seconds > 0, got 0"),
        ({"timeout": True}, r"timeout must be a number of seconds > 0, got True \(bool\)"),
        ({"store": 5}, r"store must be a URL \(str\) or a CoordinationStore, got 5 \(int\)"),
        ({"transport": None}, r"transport must be a URL \(str\) or a Transport, got None"),
        ({"progress": "print"}, r"progress must be a callable or None, got 'print' \(str\)"),
        ({"compute": "cpu"}, r"compute must be a Compute or None, got 'cpu' \(str\)"),
        ({"speculation": "true"}, r"speculation must be True or False, got 'true' \(str\)"),
    ],
)
def test_simulate_checks_its_arguments_before_anything_starts(kwargs, expect):
    # the dataset does not exist: reaching it would be a DatasetError, not a ConfigError
    with pytest.raises(pdps.ConfigError, match=expect):
        pdps.simulate(_train, dataset="memory://pdps-test-no-such-dataset", **kwargs)


def test_simulate_checks_train_and_dataset():
    with pytest.raises(pdps.ConfigError, match=r"train must be a callable \(the training function\), got 'x' \(str\)"):
        pdps.simulate("x", dataset="memory://pdps-test-no-such-dataset")
    with pytest.raises(pdps.ConfigError, match=r"dataset must be a URL \(str\) or a DataSource, got 3 \(int\)"):
        pdps.simulate(_train, dataset=3)


def test_optimizer_errors_show_only_the_arguments_the_user_gave():
    from pdps.adapters.torch_compute import TorchCompute

    with pytest.raises(pdps.ConfigError) as info:
        TorchCompute("cpu").check_optimizer("SGD", {"lrr": 0.1})
    message = str(info.value)
    assert "{'lrr': 0.1}" in message and "foreach" not in message, message
    assert "did you mean 'lr'?" in message, message
