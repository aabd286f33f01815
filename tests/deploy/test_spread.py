"""Spread variables and packs: where each variable, slot, sum and update
lives, read from the traced step; the same bits as central placement."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import make_batch
from tests.helpers import make_deployed
from tests.helpers import mlp
from tests.helpers import weights
from tfmulti import deploy
from tfmulti import devices
from tfmulti import errors
from tfmulti import fit
from tfmulti.deploy import packs
from tfmulti.plan import traffic

SPREAD = deploy.SPREAD


def _config(num_clones=2, variables_device=SPREAD, **kwargs):
  return deploy.DeploymentConfig(num_clones=num_clones, clone_on_cpu=True,
                                 variables_device=variables_device, **kwargs)


def _bn_mlp():
  return mlp(batch_norm=True)


def _all_ops(graph):
  """The ops of `graph` and of the functions it calls (a loss scale's or
  moving average's `cond` branches)."""
  ops = list(graph.get_operations())
  for function in graph._functions.values():
    ops += function.graph.get_operations()
  return ops


def _where(variable):
  return devices.canonical(devices.device_of(variable))


class TestConfig:

  def test_spread_has_no_one_variables_device(self):
    config = _config(num_clones=2, num_stages=2)
    assert config.spread_variables
    assert config.variables_device() is None
    assert config.variable_devices() == [f'/device:CPU:{i}' for i in range(4)]
    assert config.optimizer_device() == '/device:CPU:0'
    assert config.optimizer_variables_device() == '/device:CPU:0'
    assert config.owner_device('/device:CPU:3') == '/device:CPU:3'

  def test_central_owner_is_the_optimizer_device(self):
    config = _config(variables_device='/device:CPU:2')
    assert config.owner_device('/device:CPU:2') == '/device:CPU:2'
    assert config.variable_devices() == ['/device:CPU:2']
    assert _config(variables_device=None).owner_device('/device:CPU:0') == (
        '/device:CPU:0')

  def test_spread_with_parameter_servers_is_refused(self):
    with pytest.raises(errors.ConfigError,
                       match="variables_device='spread' cannot be combined "
                       'with num_ps_tasks=1'):
      _config(num_ps_tasks=1)


class TestPlacement:

  def test_largest_first_to_the_least_loaded_device(self):
    config = _config(num_clones=4)
    with config.variables_scope():
      model = _bn_mlp()
    held = dict.fromkeys(config.compute_devices(), 0)
    order = sorted(model.variables, key=lambda v: -int(np.prod(v.shape)))
    for variable in order:  # Stable: ties keep the creation order.
      expected = min(held, key=held.__getitem__)
      assert _where(variable) == expected, variable.path
      held[expected] += int(np.prod(variable.shape)) * 4
    assert len({_where(v) for v in model.variables}) == 4
    # The values a model built anywhere else has, from the same seed.
    for got, want in zip(model.variables, _bn_mlp().variables, strict=True):
      np.testing.assert_array_equal(np.array(got), np.array(want))

  def test_slots_sit_beside_their_variable(self):
    deployed = make_deployed(_config(num_clones=3),
                             optimizer_fn=keras.optimizers.Adam)
    by_name = {v.path.replace('/', '_'): _where(v)
               for v in deployed.model.trainable_variables}
    slots = [v for v in deployed.optimizer.variables
             if v.path.rsplit('/', 1)[-1].rsplit('_', 1)[0] in by_name]
    assert len(slots) == 2 * len(by_name)  # Momentum and velocity.
    for slot in slots:
      owner = by_name[slot.path.rsplit('/', 1)[-1].rsplit('_', 1)[0]]
      assert _where(slot) == owner, slot.path
    assert _where(deployed.optimizer.iterations) == '/device:CPU:0'

  @pytest.mark.parametrize('optimizer_fn', [
      lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1,
                                     global_clipnorm=0.5, use_ema=True,
                                     ema_overwrite_frequency=2),
      lambda: keras.optimizers.LossScaleOptimizer(
          keras.optimizers.SGD(0.1, momentum=0.9))],
                           ids=['adamw_clip_ema', 'loss_scale'])
  def test_sums_and_updates_run_beside_each_variable(self, optimizer_fn):
    # The mean policy computes the new moving statistics (clone 0's are
    # only copied).
    deployed = make_deployed(_config(num_clones=4), model_fn=_bn_mlp,
                             optimizer_fn=optimizer_fn,
                             batch_norm_policy='mean')
    graph = deployed.traced_step(*make_batch(8)).graph
    placement = devices.GraphPlacement()
    ops = _all_ops(graph)
    sums = [op for op in ops if op.name.startswith('optimize_clones/sum_')]
    assert len(sums) == len(deployed.model.trainable_variables)
    owners = {_where(v) for v in deployed.model.trainable_variables}
    assert {placement.of_op(op) for op in sums} == owners
    # Every value written into a variable or slot is made on its device,
    # and so is every non-scalar op of the update.
    writes = [op for op in ops if op.type.startswith('Assign')
              and 'VariableOp' in op.type]
    assert len(writes) > 2 * len(owners)
    for op in writes:
      target, value = op.inputs[0], op.inputs[1]
      if value.shape.rank:
        assert placement.of_tensor(value) == placement.of_tensor(target), (
            op.name)
    optimizer = deployed.optimizer
    scopes = (optimizer.name, getattr(optimizer, 'inner_optimizer',
                                      optimizer).name, 'update_state')
    update = [op for op in ops if op.inputs and op.outputs
              and op.outputs[0].shape.rank
              and set(op.name.split('/')) & set(scopes)]
    assert len(update) > 4 * len(owners)
    for op in update:
      assert placement.of_op(op) in owners, op.name

  def test_misplaced_model_is_refused(self):
    config = _config()
    with tf.device('/device:CPU:5'):
      model = mlp()
    with pytest.raises(errors.DeviceError,
                       match=r"not on the devices \['/device:CPU:0', "
                       "'/device:CPU:1'\\]; create the model in "
                       r'config.variables_scope\(\)'):
      deploy.deploy(config, model, keras.losses.MeanSquaredError(),
                    keras.optimizers.SGD(0.1))


def _trained(config, steps=2, rows=12, optimizer_fn=None, **options):
  deployed = make_deployed(config, model_fn=_bn_mlp,
                           optimizer_fn=optimizer_fn, **options)
  for step in range(steps):
    deployed.train_step_outputs(*make_batch(rows, seed=step))
  return deployed


def _state(deployed):
  return weights(deployed.model) + [
      np.array(v) for v in deployed.optimizer.variables]


def _assert_bits_equal(got, want):
  for mine, theirs in zip(_state(got), _state(want), strict=True):
    np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize('num_clones, num_stages, options', [
    pytest.param(2, 1, {}, marks=pytest.mark.slow),
    pytest.param(4, 1, dict(clone_shares=(3, 1, 1, 1)),
                 marks=pytest.mark.slow),
    pytest.param(2, 1, dict(accumulation_steps=2), marks=pytest.mark.slow),
    pytest.param(2, 2, dict(num_microbatches=3), marks=pytest.mark.slow),
], ids=['2_clones', '4_clones_shares', 'accumulation', '2x2_stages'])
def test_spread_is_bit_identical_to_central(num_clones, num_stages, options):
  options = dict(reproducible_rows=2, **options)
  central = _trained(_config(num_clones, None, num_stages=num_stages),
                     **options)
  spread = _trained(_config(num_clones, num_stages=num_stages), **options)
  assert len({_where(v) for v in spread.model.variables}) > 1
  assert int(spread.optimizer.iterations) == 2  # Once a step.
  _assert_bits_equal(spread, central)


@pytest.mark.parametrize('variables_device, gradient_packs', [
    pytest.param(SPREAD, 'auto', marks=pytest.mark.slow),
    pytest.param(SPREAD, 2, marks=pytest.mark.slow),
    pytest.param(None, 'auto', marks=pytest.mark.slow),
    pytest.param(None, 2, marks=pytest.mark.slow)])
def test_packs_train_as_without(variables_device, gradient_packs):
  """Equal to rounding: without atoms, Grappler may reorder a sum of
  several clones (an AddN), packed or not."""
  optimizer_fn = keras.optimizers.Adam
  plain = _trained(_config(4, variables_device), optimizer_fn=optimizer_fn)
  packed = _trained(_config(4, variables_device), optimizer_fn=optimizer_fn,
                    gradient_packs=gradient_packs)
  for mine, theirs in zip(_state(packed), _state(plain), strict=True):
    np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_packs_with_atoms_are_bit_identical():
  plain = _trained(_config(4), reproducible_rows=2)
  packed = _trained(_config(4), reproducible_rows=2, gradient_packs='auto')
  _assert_bits_equal(packed, plain)


def test_packs_send_one_gradient_tensor_per_owner():
  config = _config(4)
  deployed = make_deployed(config, model_fn=_bn_mlp, gradient_packs='auto')
  table = traffic.step_traffic(deployed, *make_batch(8))
  for device in config.compute_devices():
    # Each clone sends its gradients to the 3 other owners, one pack each.
    assert table[device].transfers_sent['gradients'] == 3, device
  plain = traffic.step_traffic(make_deployed(config, model_fn=_bn_mlp),
                               *make_batch(8))
  assert sum(t.transfers_sent['gradients'] for t in plain.values()) > 12


def test_pack_groups_cut_by_owner_dtype_and_bytes():
  config = _config(2)
  with config.variables_scope():
    model = mlp()
  variables = model.trainable_variables
  owners = [_where(v) for v in variables]
  assert packs.groups(variables, owners, 0) == ()
  auto = packs.groups(variables, owners, 'auto')
  assert sorted(k for group in auto for k in group) == list(range(4))
  assert all(len({owners[k] for k in group}) == 1 for group in auto)
  assert len(auto) == len(set(owners))
  one_owner = packs.groups(variables, ['/device:CPU:0'] * 4, 2)
  # The kernels hold most bytes: the cut is near their halves.
  assert one_owner == ((0,), (1, 2, 3))


@pytest.mark.parametrize('value, message', [
    (-1, "gradient_packs=-1: use 'auto'"), ('many', "gradient_packs='many'"),
    (True, 'gradient_packs=True')])
def test_bad_packs_are_refused(value, message):
  with pytest.raises(errors.ConfigError, match=message):
    deploy.StepOptions(gradient_packs=value)


def test_central_traffic_is_n_copies_on_the_variables_device():
  config = _config(4, '/device:CPU:4')
  deployed = make_deployed(config, model_fn=_bn_mlp)
  table = traffic.step_traffic(deployed, *make_batch(8))
  trainable = sum(int(np.prod(v.shape)) * 4
                  for v in deployed.model.trainable_variables)
  states = sum(int(np.prod(v.shape)) * 4
               for v in deployed.model.non_trainable_variables)
  host = table['/device:CPU:4']
  # The moving statistics go to clone 0 alone: its new values are the
  # step's (batch_norm_policy='clone_0'), and the runtime prunes the
  # other clones' reads, which nothing needs.
  assert host.sent['variables'] == 4 * trainable + states
  assert host.received['gradients'] == 4 * trainable
  assert host.held == traffic.held_bytes(
      deployed.model.variables + deployed.optimizer.variables)[
          '/device:CPU:4']


def test_a_checkpoint_restores_across_placements(tmp_path):
  spread = _trained(_config(4), optimizer_fn=keras.optimizers.Adam)
  path = tf.train.Checkpoint(model=spread.model,
                             optimizer=spread.optimizer).save(
                                 str(tmp_path / 'ckpt'))
  central = make_deployed(_config(2, None), model_fn=lambda: _bn_mlp(),
                          optimizer_fn=keras.optimizers.Adam)
  tf.train.Checkpoint(model=central.model,
                      optimizer=central.optimizer).restore(path)
  _assert_bits_equal(central, spread)
  assert {_where(v) for v in central.model.variables} == {'/device:CPU:0'}


@pytest.mark.slow
def test_fit_with_spread_variables_trains_the_central_bits():
  images, labels = make_batch(24)
  trained = []
  for variables_device in (None, SPREAD):
    config = _config(2, variables_device)
    with config.variables_scope():
      model = _bn_mlp()
    towers = fit.TowersModel(model, config, reproducible_rows=2,
                                gradient_packs='auto')
    towers.compile(optimizer=keras.optimizers.Adam(0.01),
                   loss=keras.losses.SparseCategoricalCrossentropy(
                       from_logits=True))
    towers.fit(images, labels, batch_size=8, epochs=2, shuffle=False,
               verbose=0)
    trained.append(towers)
  central, spread = trained
  assert len({_where(v) for v in spread.model.variables}) == 2
  for got, want in zip(weights(spread.model), weights(central.model),
                       strict=True):
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize('build, rows', [
    (lambda: mlp(batch_norm=True, dropout=True), 24),
    (lambda: keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=3), 8),
], ids=['dropout_batch_norm', 'mobilenet_v2'])
def test_models_a_user_brings_train_the_central_bits_spread(build, rows):
  """Dropout (its masks folded by row) and a keras.applications model,
  through `fit`: spread over 2 clones, the bits of central placement."""
  rng = np.random.default_rng(0)
  trained = []
  for variables_device in (None, SPREAD):
    keras.utils.set_random_seed(0)
    config = _config(2, variables_device)
    with config.variables_scope():
      model = build()
    shape = model.inputs[0].shape[1:]
    images = rng.normal(size=(rows, *shape)).astype(np.float32)
    labels = rng.integers(0, 3, size=rows).astype(np.int32)
    rng = np.random.default_rng(0)
    towers = fit.TowersModel(model, config, reproducible_rows=2)
    towers.compile(optimizer=keras.optimizers.SGD(0.01),
                   loss=keras.losses.SparseCategoricalCrossentropy(
                       from_logits=not model.name.startswith('mobilenet')))
    towers.fit(images, labels, batch_size=rows // 2, epochs=1,
               shuffle=False, verbose=0)
    trained.append(towers)
  central, spread = trained
  assert len({_where(v) for v in spread.model.variables}) == 2
  for got, want in zip(weights(spread.model), weights(central.model),
                       strict=True):
    np.testing.assert_array_equal(got, want)


def test_an_embeddings_gradient_moves_the_touched_rows_not_the_table():
  """Each clone sends the table's gradient as slices: a value row and an
  index a looked-up row, not the 2 MB a dense gradient would be."""
  vocab, width, tokens = 32_768, 16, 5

  def embedding():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((tokens,), dtype='int32')
    x = keras.layers.Embedding(vocab, width)(inputs)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(3)(x))
  config = _config(2, '/device:CPU:2')
  deployed = make_deployed(config, model_fn=embedding)
  rows = 8
  ids = np.arange(rows * tokens, dtype=np.int32).reshape(rows, tokens)
  table = traffic.step_traffic(deployed, ids, np.zeros(rows, np.int32))
  head = (width * 3 + 3) * 4  # The Dense layer's dense gradients.
  slices = (rows // 2) * tokens * (width * 4 + 4)  # Values and an int32 id.
  received = table['/device:CPU:2'].received['gradients']
  assert 2 * (slices + head) <= received <= 1.1 * 2 * (slices + head)
  assert received < vocab * width * 4 / 100  # A dense gradient's bytes.
