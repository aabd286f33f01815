"""Uneven clone shares and gradient accumulation: exact, on every path."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import assert_same_checkpoints
from tests.helpers import assert_same_steps
from tests.helpers import make_batch
from tests.helpers import make_deployed
from tests.helpers import make_loss
from tests.helpers import mlp
from tests.helpers import weights
from tfmulti import deploy
from tfmulti import distribute
from tfmulti import errors
from tfmulti import layouts

OPTIMIZERS = {
    'sgd': lambda: keras.optimizers.SGD(0.1),
    'momentum': lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    'adam': lambda: keras.optimizers.Adam(0.01),
}


def _reference(optimizer='momentum'):
  return make_deployed(deploy.DeploymentConfig(clone_on_cpu=True),
                       optimizer_fn=OPTIMIZERS[optimizer],
                       summarize_gradients=True)


def _mirrored(num_replicas, optimizer='momentum', **kwargs):
  config = deploy.DeploymentConfig(num_clones=num_replicas, clone_on_cpu=True)
  strategy = distribute.make_strategy(distribute.MIRRORED, config)
  with strategy.scope():
    model, optimizer = mlp(), OPTIMIZERS[optimizer]()
  return distribute.DistributedModel(
      strategy, model, make_loss(), optimizer,
      deploy.StepOptions(summarize_gradients=True, **kwargs))


def _towers(num_clones, optimizer='momentum', **kwargs):
  config = deploy.DeploymentConfig(num_clones=num_clones, clone_on_cpu=True)
  return make_deployed(config, optimizer_fn=OPTIMIZERS[optimizer],
                       summarize_gradients=True, **kwargs)


def test_split_rows_by_largest_remainder():
  assert layouts.split_rows(8, [3, 1]) == [6, 2]
  assert layouts.split_rows(8, [5, 3]) == [5, 3]
  assert layouts.split_rows(10, [1, 1, 2]) == [3, 2, 5]  # Leftover to 0.
  assert layouts.split_rows(7, [1, 1]) == [4, 3]
  assert layouts.split_rows(5, [0.75, 0.25]) == [4, 1]


@pytest.mark.parametrize('shares,rows', [((3, 1), 8), ((5, 3), 8),
                                         ((1, 1, 2), 10)])
def test_shares_on_the_towers_equal_one_device(shares, rows):
  towers = _towers(len(shares), clone_shares=shares)
  assert_same_steps(towers, _reference(), rows)


@pytest.mark.parametrize('shares,rows', [((3, 1), 8), ((5, 3), 8),
                                         ((1, 1, 2), 10)])
def test_shares_on_mirrored_equal_one_device(shares, rows):
  mirrored = _mirrored(len(shares), clone_shares=shares)
  assert_same_steps(mirrored, _reference(), rows)


def test_clones_are_weighted_by_rows_not_equally():
  # With shares 3:1 the clones' mean losses, averaged equally, are not the
  # batch's mean loss; each clone's part is its mean times rows / 8.
  towers = _towers(2, clone_shares=(3, 1))
  images, labels = make_batch(8)
  model = towers.model
  means = [float(make_loss()(labels[a:b], model(images[a:b])))
           for a, b in ((0, 6), (6, 8))]
  outputs = towers.train_step_outputs(images, labels)
  data_loss = float(outputs.total - outputs.regularization)
  np.testing.assert_allclose(data_loss, means[0] * 6 / 8 + means[1] * 2 / 8,
                             rtol=1e-5)
  assert abs(data_loss - sum(means) / 2) > 1e-3
  np.testing.assert_allclose(
      float(outputs.clones[1]), means[1] * 2 / 8, rtol=1e-5)


def test_mean_batch_norm_policy_weights_clones_by_rows():
  momentum = 0.5
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with tf.device(config.variables_device()):
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.BatchNormalization(
        momentum=momentum)(inputs))
  deployed = deploy.deploy(config, model,
                           lambda y, out: tf.reduce_mean(out * y),
                           keras.optimizers.SGD(0.0),
                           batch_norm_policy=deploy.BN_MEAN,
                           clone_shares=(3, 1))
  images = np.array([[1., 2.], [3., 6.], [10., 0.], [20., 4.],
                     [-1., 0.5], [2., 2.], [7., -3.], [0., 1.]], np.float32)
  deployed.train_step(images, np.ones((8, 2), np.float32))
  shards = (images[:6], images[6:])
  want_mean = sum(w * (1 - momentum) * s.mean(axis=0)
                  for w, s in zip((0.75, 0.25), shards))
  want_variance = sum(w * (momentum + (1 - momentum) * s.var(axis=0))
                      for w, s in zip((0.75, 0.25), shards))
  layer = model.layers[1]
  np.testing.assert_allclose(layer.moving_mean, want_mean, atol=1e-6)
  np.testing.assert_allclose(layer.moving_variance, want_variance, atol=1e-6)


@pytest.mark.parametrize('optimizer', sorted(OPTIMIZERS))
def test_accumulation_on_the_towers_equals_one_device_on_k_batches(optimizer):
  towers = _towers(2, optimizer, accumulation_steps=3)
  assert_same_steps(towers, _reference(optimizer), rows=12)


@pytest.mark.parametrize('optimizer', [
    pytest.param(name, marks=[pytest.mark.slow] if name == 'adam' else [])
    for name in sorted(OPTIMIZERS)])
def test_accumulation_on_mirrored_equals_one_device_on_k_batches(optimizer):
  mirrored = _mirrored(2, optimizer, accumulation_steps=2)
  assert_same_steps(mirrored, _reference(optimizer), rows=8)
  # The distributed dataset's elements hold each replica's accumulation steps.
  images, labels = make_batch(8, seed=5)
  element = next(iter(mirrored.distribute_dataset(
      tf.data.Dataset.from_tensors((images, labels)))))
  reference = _reference(optimizer)
  for _ in range(2):  # The same weights as the reference's after 2 steps.
    reference.train_step(*make_batch(8, seed=_))
  want = reference.train_step_outputs(images, labels)
  np.testing.assert_allclose(mirrored.train_step_outputs(*element).total,
                             want.total, atol=1e-5)


@pytest.mark.slow
def test_shares_accumulation_and_stages_compose():
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True,
                                   num_stages=2)
  composed = make_deployed(
      config, summarize_gradients=True, clone_shares=(3, 1),
      accumulation_steps=2, num_microbatches=2)
  assert_same_steps(composed, _reference(), rows=16)


def test_accumulators_live_on_the_variables_device_in_a_loop():
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True,
                                   variables_device='/device:CPU:2')
  towers = make_deployed(config, accumulation_steps=4)
  graph = towers.traced_step(*make_batch(16)).graph
  loops = [op for op in graph.get_operations() if op.type == 'While']
  assert len(loops) == 1  # Accumulation steps 1..3; step 0 comes first.
  body = graph._functions[loops[0].get_attr('body').name].definition
  sums = [node for node in body.node_def
          if node.name.startswith('while/accumulate/') and node.op == 'AddV2']
  # One sum per variable (4), per scalar (total, regularization, 2 clones),
  # and the accumulation step counter.
  assert len(sums) == 4 + 4 + 1
  assert {node.device for node in sums} == {'/device:CPU:2'}


def test_one_overflowing_accumulation_step_skips_the_whole_update_once():
  towers = make_deployed(
      deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True),
      model_fn=lambda: mlp(dtype='mixed_float16'),
      optimizer_fn=lambda: keras.optimizers.LossScaleOptimizer(
          keras.optimizers.SGD(0.1)),
      accumulation_steps=2)
  before = weights(towers.model)
  scale = float(towers.optimizer.dynamic_scale)
  images, labels = make_batch(8)
  images[5] = 1e6  # Overflows float16 (max 65504) in accumulation step 1.
  towers.train_step(images, labels)
  for got, want in zip(weights(towers.model), before):
    np.testing.assert_array_equal(got, want)
  assert float(towers.optimizer.dynamic_scale) == scale / 2
  towers.train_step(*make_batch(8))  # A finite step then updates.
  assert any(np.any(a != b) for a, b in zip(weights(towers.model), before))


class TestClearErrors:

  @pytest.mark.parametrize('shares,match', [
      ((1, 2, 3), r'clone_shares=1,2,3: give one share per clone '
       r'\(num_clones=2\)'),
      ((1, 0), 'clone_shares=1,0: every share must be a number > 0'),
      ((1, -2), 'clone_shares=1,-2: every share'),
  ])
  def test_bad_shares(self, shares, match):
    with pytest.raises(errors.ConfigError, match=match):
      _towers(2, clone_shares=shares)
    with pytest.raises(errors.ConfigError, match=match.replace(
        'num_clones', 'num_replicas')):
      _mirrored(2, clone_shares=shares)

  def test_a_share_that_leaves_a_clone_no_rows(self):
    towers = _towers(2, clone_shares=(100, 1))
    with pytest.raises(errors.ConfigError,
                       match='leaves clone 1 of 2 no rows .clone_shares=100,1'):
      towers.train_step(*make_batch(8))
    assert int(towers.optimizer.iterations) == 0

  def test_lockstep_clones_refuse_shares_and_accumulation(self):
    config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
    for options in (dict(clone_shares=(3, 1)), dict(accumulation_steps=2)):
      with pytest.raises(errors.UnsupportedError,
                         match='cannot be combined with sync_batch_norm=True'):
        make_deployed(config, sync_batch_norm=True, **options)

  def test_accumulation_of_zero(self):
    with pytest.raises(errors.ConfigError,
                       match='accumulation_steps=0: must be an integer >= 1'):
      _towers(2, accumulation_steps=0)

  def test_a_batch_that_does_not_make_equal_accumulation_steps(self):
    towers = _towers(2, accumulation_steps=3)
    with pytest.raises(errors.ConfigError, match='accumulation_steps=3'):
      towers.train_step(*make_batch(8))


@pytest.mark.slow
def test_train_py_shares_equal_one_device_on_towers_and_mirrored(run_train,
                                                                 caplog):
  common = dict(optimizer='momentum', learning_rate=0.05, train_steps=3)
  one = run_train(strategy='single', num_clones=1, batch_size=8,
                  **common)['checkpoint']
  for strategy in ('towers', 'mirrored'):
    with caplog.at_level('INFO', logger='absl'):
      metrics = run_train(strategy=strategy, num_clones=2, batch_size=4,
                          clone_shares=['3', '1'], **common)
    assert 'clone shares 3:1: 6/2 rows of each 8-row batch' in caplog.text
    assert metrics['global_batch_size'] == 8
    assert metrics['clone_shares'] == [3, 1]
    assert_same_checkpoints(metrics['checkpoint'], one)


@pytest.mark.slow
def test_train_py_auto_shares_balance_and_train(run_train, caplog):
  with caplog.at_level('INFO', logger='absl'):
    metrics = run_train(num_clones=2, batch_size=8, clone_shares=['auto'],
                        rebalance_every_steps=2, train_steps=3)
  assert metrics['steps'] == 3
  assert 'clone shares ' in caplog.text and 'predicted step' in caplog.text
  assert sum(metrics['clone_shares']) == 16  # Measured, out of 16.


@pytest.mark.slow
def test_train_py_accumulation_equals_the_bigger_batch(run_train):
  common = dict(optimizer='adam', num_clones=2, train_steps=3)
  accumulated = run_train(batch_size=4, accumulation_steps=2, **common)
  assert accumulated['global_batch_size'] == 16  # Rows of one update.
  assert accumulated['steps'] == 3  # Steps count updates.
  assert accumulated['accumulation_steps'] == 2
  bigger = run_train(batch_size=8, **common)
  assert_same_checkpoints(accumulated['checkpoint'], bigger['checkpoint'])


@pytest.mark.slow
def test_train_py_accumulation_resumes_exactly(run_train, tmp_path):
  common = dict(optimizer='momentum', learning_rate=0.05, num_clones=2,
                batch_size=4, accumulation_steps=2)
  model_dir = str(tmp_path / 'resumed')
  run_train(model_dir=model_dir, train_steps=2, **common)
  resumed = run_train(model_dir=model_dir, train_steps=4, **common)
  assert (resumed['resumed_from_step'], resumed['steps']) == (2, 4)
  whole = run_train(model_dir=str(tmp_path / 'whole'), train_steps=4,
                    **common)
  assert_same_checkpoints(resumed['checkpoint'], whole['checkpoint'])


@pytest.mark.parametrize('values, message', [
    (dict(clone_shares=['1', '2', '3']),
     r'clone_shares=1,2,3: give one share per clone \(num_clones=2\)'),
    (dict(clone_shares=['0', '1']), 'clone_shares=0,1: every share must'),
    (dict(clone_shares=['a', 'b']), '--clone_shares=a,b: give numbers'),
    (dict(clone_shares=['3', '1'], strategy='central_storage'),
     "clone_shares=.* is not available with strategy='central_storage'; "
     'use --strategy=towers or mirrored'),
    (dict(clone_shares=['auto'], strategy='mirrored'),
     "clone_shares=auto is not available with strategy='mirrored'; use "
     '--strategy=towers, or drop it.'),
    (dict(accumulation_steps=0), 'accumulation_steps=0: must be an integer'),
    (dict(rebalance_every_steps=0), 'rebalance_every_steps=0: must be'),
    (dict(model='resnet8_thin', sync_batch_norm=True, accumulation_steps=2),
     'accumulation_steps=2 cannot be combined with sync_batch_norm=True'),
    (dict(model='resnet8_thin', sync_batch_norm=True,
          clone_shares=['3', '1']),
     r'clone_shares=\(3, 1\) cannot be combined with sync_batch_norm=True'),
])
def test_bad_share_and_accumulation_flags_stop_with_one_line(run_train,
                                                             tmp_path, values,
                                                             message):
  with pytest.raises(SystemExit, match=message):
    run_train(model_dir=str(tmp_path / 'run'), num_clones=2, **values)
  assert not (tmp_path / 'run').exists()


def _loop_and_update_ops(run):
  """(loops, variable writes inside the step's loops, writes outside)."""
  graph, = [f.graph for f in run.step_function._list_all_concrete_functions()]
  inside, loops = [], 0
  for op in graph.get_operations():
    if op.type == 'While':
      loops += 1
      body = graph._functions[op.get_attr('body').name].definition
      inside += [n.op for n in body.node_def if n.op.startswith('Assign')]
  outside = [op.type for op in graph.get_operations()
             if op.type.startswith('Assign')]
  return loops, inside, outside


# The towers loop once over their clones' accumulation steps; mirrored replicas
# each loop over their own.
@pytest.mark.parametrize('make,num_loops', [(_towers, 1), (_mirrored, 2)])
def test_the_update_and_its_all_reduce_run_once_after_the_accumulation_steps(
    make, num_loops):
  run = make(2, accumulation_steps=3)
  run.train_step(*make_batch(12))
  loops, inside, outside = _loop_and_update_ops(run)
  assert loops == num_loops
  # Keras all-reduces inside apply_gradients, which writes the variables:
  # no write inside the accumulation steps' loop means one all-reduce a step.
  assert inside == []
  assert len(outside) >= len(run.model.trainable_variables)
