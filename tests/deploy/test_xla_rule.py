"""Tests for `xla='auto'` (`deploy.xla_rule`): the rule, and what it
compiles on this machine's CPUs."""

import pytest

from tfmulti import deploy
from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import step_options
from tfmulti.deploy import xla_rule

GPUS = deploy.DeploymentConfig(num_clones=2)  # GPU:0 and GPU:1.
CPUS = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)


def test_whole_clones_on_gpus_compile():
  options = xla_rule.resolve(GPUS, step_options.StepOptions())
  assert options.xla is True


@pytest.mark.parametrize('config, fields, reason', [
    (CPUS, {}, 'the clones run on CPUs'),
    (deploy.DeploymentConfig(num_clones=2, num_stages=2), {},
     'stages or micro-batches'),
    (GPUS, dict(num_microbatches=2), 'stages or micro-batches'),
    (GPUS, dict(reproducible_rows=2), 'reproducible_rows'),
    (GPUS, dict(sync_batch_norm=True), 'synchronized BatchNorm'),
])
def test_auto_stays_off_where_a_guarantee_or_the_device_says(config, fields,
                                                             reason):
  options = step_options.StepOptions(**fields)
  assert reason in xla_rule.why_not(config, options)
  assert xla_rule.resolve(config, options).xla is False


def test_op_determinism_turns_auto_off(monkeypatch):
  assert xla_rule.why_not(GPUS, step_options.StepOptions()) is None
  monkeypatch.setattr(keras_internals, 'op_determinism_enabled', lambda: True)
  assert 'op determinism' in xla_rule.why_not(GPUS,
                                              step_options.StepOptions())


def test_a_given_value_is_kept_and_a_bad_one_refused():
  for value in (True, False):
    options = step_options.StepOptions(xla=value)
    assert xla_rule.resolve(CPUS, options).xla is value
  with pytest.raises(errors.ConfigError, match="xla='yes': use True, False "
                     "or 'auto'"):
    step_options.StepOptions(xla='yes')
  with pytest.raises(errors.ConfigError, match='xla=1: use True'):
    step_options.StepOptions(xla=1)
  # Off asks nothing of a strategy; on does.
  assert 'xla' not in step_options.StepOptions(xla=False).in_use()
  assert 'xla' in step_options.StepOptions(xla=True).in_use()
