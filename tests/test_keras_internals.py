"""The private Keras conventions tfmulti reads, pinned to the Keras
releases they were tested on: a Keras that moves one fails here."""

import ast
import os

import keras
import numpy as np
import tensorflow as tf

from tests.helpers import REPO
from tfmulti import keras_internals


def _model():
  keras.utils.set_random_seed(0)
  x = keras.Input((4,))
  h = keras.layers.Dense(3, kernel_regularizer='l2',
                         activity_regularizer='l2')(x)
  h = keras.layers.Dropout(0.5)(keras.layers.BatchNormalization()(h))
  return keras.Model(x, keras.layers.Dense(2, bias_regularizer='l1')(h))


def test_the_keras_release_is_a_tested_one():
  assert keras.__version__.rsplit('.', 1)[0] in keras_internals.TESTED_KERAS


def test_an_op_built_earlier_waits_for_a_gate_made_later():
  seen = {}

  @tf.function
  def step(x):
    doubled = x * 2.0
    gate = tf.no_op(name='gate')
    keras_internals.wait_for(doubled.op, gate)
    seen['control_inputs'] = [op.name for op in doubled.op.control_inputs]
    return doubled
  assert float(step(tf.constant(3.0))) == 6.0
  assert seen['control_inputs'] == ['gate']


def test_an_empty_optional_carries_a_loop_bodys_value():
  @tf.function(autograph=False)
  def last_of(n):
    empty = tf.experimental.Optional.empty(None)

    def body(i, _):
      value = tf.experimental.Optional.from_value((i * 2, {'i': i}))
      keras_internals.set_element_spec(empty, value.element_spec)
      return i + 1, value
    _, carried = tf.while_loop(lambda i, _: i < n, body,
                               (tf.constant(0), empty))
    keras_internals.set_element_spec(carried, empty.element_spec)
    return carried.get_value()
  doubled, named = last_of(tf.constant(3))
  assert (int(doubled), int(named['i'])) == (4, 2)


def test_stateless_losses_are_add_loss_terms_then_penalties():
  model = _model()
  values = ([v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables])
  _, _, losses = model.stateless_call(*values, np.ones((2, 4), np.float32),
                                      training=True, return_losses=True)
  added, penalties = keras_internals.split_losses(model, losses)
  assert (len(added), len(penalties)) == (1, 2)
  want = sum(float(v.regularizer(v)) for v in model.trainable_weights
             if v.regularizer is not None)
  np.testing.assert_allclose(sum(float(p) for p in penalties), want,
                             rtol=1e-6)


def test_seed_states_are_found_and_fold_apart():
  model = _model()
  (index,) = keras_internals.seed_indices(model)
  state = model.non_trainable_variables[index]
  assert 'seed_generator' in state.path and state.dtype == 'int64'
  values = [v.value for v in model.non_trainable_variables]
  folded = [keras_internals.fold_seeds(values, [index], offset)[index]
            for offset in (0, 8)]
  assert not np.array_equal(folded[0], folded[1])
  advanced = [folded[0] + np.array([0, 3])]
  back = keras_internals.unfold_seeds(advanced, [folded[0]], [values[index]],
                                      [0])
  np.testing.assert_array_equal(back[0], np.array(values[index]) + [0, 3])


def test_synchronized_batch_norms_restores_the_config():
  model = _model()
  (layer,) = keras_internals.batch_norms(model)
  with keras_internals.synchronized_batch_norms(model):
    assert layer.synchronized
  assert not layer.synchronized and not layer.get_config()['synchronized']


def test_dict_inputs_follow_the_model_inputs():
  a, b = keras.Input((1,), name='a'), keras.Input((2,), name='b')
  model = keras.Model({'b': b, 'a': a},
                      keras.layers.Concatenate()([a, b]))
  flat = keras_internals.flat_inputs(model, {'a': 'A', 'b': 'B'})
  assert flat == [{'a': 'A', 'b': 'B'}[t.name] for t in model.inputs]


def test_a_compiled_loss_counts_in_its_output_metrics_when_tracked():
  keras.utils.set_random_seed(0)
  x = keras.Input((4,))
  model = keras.Model(x, {'a': keras.layers.Dense(2, name='a')(x),
                          'b': keras.layers.Dense(1, name='b')(x)})
  model.compile(loss={'a': 'mse', 'b': 'mae'}, loss_weights={'a': 1.0,
                                                               'b': 0.5})
  rng = np.random.default_rng(0)
  data = (rng.normal(size=(5, 4)).astype(np.float32),
          {'a': rng.normal(size=(5, 2)).astype(np.float32),
           'b': rng.normal(size=(5, 1)).astype(np.float32)})
  keras_internals.build_compiled(model, data)
  outputs = model(data[0])
  total, output_losses = keras_internals.compiled_loss(model, data[1],
                                                       outputs)
  metrics = keras_internals.compiled_loss_metrics(model)
  assert [m.name for m in metrics] == ['a_loss', 'b_loss']
  assert all(float(m.count) == 0 for m in metrics)  # A call alone: none.
  want = [keras.losses.mean_squared_error(data[1]['a'], outputs['a']),
          keras.losses.mean_absolute_error(data[1]['b'], outputs['b'])]
  want = [float(np.mean(w)) for w in want]
  np.testing.assert_allclose(output_losses, want, rtol=1e-6)
  np.testing.assert_allclose(total, want[0] + 0.5 * want[1], rtol=1e-6)
  keras_internals.track_output_losses(model, output_losses)
  assert [float(m.count) for m in metrics] == [1.0, 1.0]  # A batch: one.
  np.testing.assert_allclose([m.result() for m in metrics], want, rtol=1e-6)


# What reads Keras's or TensorFlow's private names, anywhere else.
_PRIVATE_MODULES = ('keras.src', 'tensorflow.python', 'tensorflow.tsl')
# A namedtuple's own API, whose names start with '_'.
_NAMEDTUPLE = {'_replace', '_fields', '_asdict', '_make'}


def _package_sources():
  package = os.path.join(REPO, 'tfmulti')
  for folder, _, files in os.walk(package):
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        yield os.path.relpath(path, REPO), ast.parse(open(path).read())


def _own_private_names(trees):
  """The '_' names tfmulti defines: its functions, classes, attributes."""
  own = set()
  for tree in trees:
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        own.add(node.name)
      elif isinstance(node, ast.Attribute) and isinstance(node.ctx,
                                                          ast.Store):
        own.add(node.attr)
      elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        own.add(node.id)
  return own


def _private_reads(path, tree, own):
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      names = ([node.module] if isinstance(node, ast.ImportFrom)
               else [alias.name for alias in node.names])
      yield from (f'{path}:{node.lineno} imports {name}' for name in names
                  if name and name.startswith(_PRIVATE_MODULES))
    elif isinstance(node, ast.Attribute) and (
        node.attr == '__internal__' or (
            node.attr.startswith('_') and not node.attr.startswith('__')
            and node.attr not in own | _NAMEDTUPLE)):
      yield f'{path}:{node.lineno} reads {ast.unparse(node)}'


def test_private_names_are_read_here_alone():
  sources = list(_package_sources())
  own = _own_private_names([tree for path, tree in sources
                            if not path.endswith('keras_internals.py')])
  found = [read for path, tree in sources
           if not path.endswith('keras_internals.py')
           for read in _private_reads(path, tree, own)]
  assert not found, found


def test_the_private_reads_reader_sees_one():
  tree = ast.parse('import tensorflow.python.eager\n'
                   'x = model._flatten_layers()\n')
  assert len(list(_private_reads('m.py', tree, set()))) == 2
