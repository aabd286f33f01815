"""The command line's mesh and layout map: `--mesh_shape`, `--mesh_axes`
and `--layout_map` store each variable the map splits as its shards over
the clones, in a checkpoint one device resumes from; bad ones stop in one
line before anything is written."""

from absl.testing import flagsaver
import pytest

from tests.helpers import assert_same_checkpoints
from tests.helpers import checkpoint_tensors
from tfmulti import cli

USER_MODULE = """
import keras


def dense(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  x = keras.layers.Flatten()(inputs)
  x = keras.layers.Rescaling(1 / 255)(x)
  x = keras.layers.Dense(32, activation='relu', name='hidden')(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes,
                                                name='logits')(x))


def pixels(input_shape, num_classes):
  # Each pixel's value an id of a table: the table a plan lays out.
  inputs = keras.Input(input_shape)
  ids = keras.ops.clip(keras.ops.cast(keras.layers.Flatten()(inputs),
                                      'int32'), 0, 255)
  x = keras.layers.Embedding(256, 8, name='pixels')(ids)
  x = keras.layers.GlobalAveragePooling1D()(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes,
                                                name='logits')(x))


def primes(input_shape, num_classes):
  # A table of 251 rows and 7 columns: no axis of 2 divides either.
  inputs = keras.Input(input_shape)
  ids = keras.ops.clip(keras.ops.cast(keras.layers.Flatten()(inputs),
                                      'int32'), 0, 250)
  x = keras.layers.Embedding(251, 7, name='primes')(ids)
  x = keras.layers.GlobalAveragePooling1D()(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes,
                                                name='logits')(x))


def prime_layout(device_mesh):
  layouts = keras.distribution.LayoutMap(device_mesh)
  layouts['primes/embeddings'] = ('batch', 'model')
  return layouts


class _Owned(keras.Model):
  def get_layout_map(self, device_mesh):
    return layout_map(device_mesh)


def owned(input_shape, num_classes):
  model = dense(input_shape, num_classes)
  return _Owned(model.inputs, model.outputs)


def layout_map(device_mesh):
  layouts = keras.distribution.LayoutMap(device_mesh)
  layouts['hidden/kernel'] = ('batch', 'model')
  layouts['logits/kernel'] = ('model', None)
  return layouts


def fsdp(device_mesh):
  # Each kernel split by its outputs over the batch axis: storage alone.
  layouts = keras.distribution.LayoutMap(device_mesh)
  layouts['.*/kernel'] = (None, 'batch')
  return layouts


def misspelt(device_mesh):
  layouts = keras.distribution.LayoutMap(device_mesh)
  layouts['hiden/kernel'] = ('batch', 'model')
  return layouts


def not_a_map(device_mesh):
  return {'hidden/kernel': ('batch', 'model')}
"""

MESH = dict(mesh_shape=['2', '2'], mesh_axes=['batch', 'model'],
            num_clones=4)


@pytest.fixture
def user_module(tmp_path):
  path = tmp_path / 'user_models.py'
  path.write_text(USER_MODULE)
  return str(path)


@pytest.mark.slow
@pytest.mark.parametrize('model, layout_map', [
    ('dense', 'layout_map'), ('owned', 'model')])
def test_a_mesh_run_shards_and_one_device_resumes_it(
    run_train, user_module, tmp_path, caplog, model, layout_map):
  with caplog.at_level('INFO', logger='absl'):
    sharded = run_train(
        model=f'{user_module}:{model}', train_steps=2,
        layout_map=(layout_map if layout_map == 'model' else
                    f'{user_module}:{layout_map}'), **MESH,
        model_dir=str(tmp_path / 'run'))
  assert 'Variables sharded by their layouts: 2 of 4' in caplog.text
  # The checkpoint holds whole weights and slots, as one device's would.
  saved = checkpoint_tensors(sharded['checkpoint'])
  assert {tuple(v.shape) for v in saved.values()} >= {(784, 32), (32, 10)}
  plain = run_train(model=f'{user_module}:{model}', train_steps=2,
                    num_clones=4, model_dir=str(tmp_path / 'plain'))
  assert_same_checkpoints(sharded['checkpoint'], plain['checkpoint'])
  resumed = run_train(model=f'{user_module}:{model}', train_steps=3,
                      num_clones=1, batch_size=16,  # The same global batch.
                      model_dir=str(tmp_path / 'run'))
  assert resumed['resumed_from_step'] == 2 and resumed['steps'] == 3


@pytest.mark.slow
def test_planned_tables_train_as_plain_towers(run_train, user_module,
                                              tmp_path, caplog):
  """--plan_tables without a layout map: the one table, split both ways
  over the (2, 2) mesh, trains to the checkpoint of plain towers."""
  with caplog.at_level('INFO', logger='absl'):
    planned = run_train(model=f'{user_module}:pixels', train_steps=2,
                        plan_tables=True, **MESH,
                        model_dir=str(tmp_path / 'run'))
  assert ('table pixels/embeddings: by rows over batch and by columns over '
          'model on devices 0, 1, 2, 3') in caplog.text
  plain = run_train(model=f'{user_module}:pixels', train_steps=2,
                    num_clones=4, model_dir=str(tmp_path / 'plain'))
  assert_same_checkpoints(planned['checkpoint'], plain['checkpoint'])


@pytest.mark.slow
def test_a_prime_table_by_rows_and_columns_trains_as_plain_towers(
    run_train, user_module, tmp_path, caplog):
  """251 rows by 7 columns over a (2, 2) mesh: unequal shards (126 and
  125 rows, 4 and 3 columns), the checkpoint of plain towers."""
  with caplog.at_level('INFO', logger='absl'):
    split = run_train(model=f'{user_module}:primes', train_steps=2,
                      layout_map=f'{user_module}:prime_layout', **MESH,
                      model_dir=str(tmp_path / 'run'))
  assert 'Variables sharded by their layouts: 1 of 3' in caplog.text
  plain = run_train(model=f'{user_module}:primes', train_steps=2,
                    num_clones=4, model_dir=str(tmp_path / 'plain'))
  assert_same_checkpoints(split['checkpoint'], plain['checkpoint'])


@pytest.mark.parametrize('joins', [
    dict(gather_ahead=0),
    pytest.param(dict(gather_ahead=2), marks=pytest.mark.slow),
    pytest.param(dict(keep_joins=True), marks=pytest.mark.slow)])
def test_joins_released_or_kept_train_as_plain_towers(
    run_train, user_module, tmp_path, joins):
  """Kernels split over the batch axis (FSDP's layout), joined in their
  layers' calls however many layers ahead, or joined once and kept: the
  checkpoint of plain towers."""
  split = run_train(model=f'{user_module}:dense', train_steps=2,
                    layout_map=f'{user_module}:fsdp', mesh_shape=['4'],
                    mesh_axes=['batch'], num_clones=4, **joins,
                    model_dir=str(tmp_path / 'run'))
  plain = run_train(model=f'{user_module}:dense', train_steps=2,
                    num_clones=4, model_dir=str(tmp_path / 'plain'))
  assert_same_checkpoints(split['checkpoint'], plain['checkpoint'])


def test_a_derived_map_trains_as_plain_towers(run_train, user_module,
                                              tmp_path, caplog):
  """`--layout_map=auto`: the hidden kernel (100 KiB) split by its
  columns over 'model' and its rows over 'batch', the small rest whole."""
  with caplog.at_level('INFO', logger='absl'):
    split = run_train(model=f'{user_module}:dense', train_steps=2,
                      **dict(MESH, layout_map='auto'),
                      model_dir=str(tmp_path / 'run'))
  assert 'Variables sharded by their layouts: 1 of 4' in caplog.text
  assert "Layers computed where their kernels' blocks live: hidden." in (
      caplog.text)
  plain = run_train(model=f'{user_module}:dense', train_steps=2,
                    num_clones=4, model_dir=str(tmp_path / 'plain'))
  assert_same_checkpoints(split['checkpoint'], plain['checkpoint'])


@pytest.mark.parametrize('values, message', [
    (dict(plan_tables=True), r'--mesh_shape, --mesh_axes missing: a mesh '
     'needs its shape, its axis names and a layout map or --plan_tables'),
    (dict(mesh_shape=['2', '2']), r'--mesh_axes, --layout_map or '
     '--plan_tables missing: a mesh needs its shape, its axis names and a '
     'layout map'),
    (dict(MESH, mesh_shape=['2', 'x'], layout_map='model'),
     r'--mesh_shape=2,x: give a device count an axis'),
    (dict(MESH, layout_map='model', strategy='mirrored'),
     r'--mesh_shape with --strategy=mirrored: the towers shard'),
    (dict(MESH, layout_map='model', num_clones=2),
     r'num_clones=2 with a mesh of \(2, 2\): one clone a mesh device'),
    (dict(MESH, layout_map='{module}:nothing'),
     r"--layout_map=\S+user_models.py:nothing: \S+ has no function "
     r"'nothing'; define FUNCTION\(device_mesh\) returning a "
     'keras.distribution.LayoutMap there'),
    (dict(MESH, layout_map='{module}:not_a_map'),
     r'--layout_map=\S+:not_a_map returned dict, not a '
     'keras.distribution.LayoutMap'),
    (dict(MESH, layout_map='model', model='{module}:dense'),
     r"layout_map='model': model '\w+' \(nor a backbone of it\) has no "
     r'get_layout_map\(device_mesh\)'),
    (dict(MESH, layout_map='{module}:misspelt', model='{module}:dense',
          strict_layout_map=True),
     r"layout map key 'hiden/kernel' matches no variable of model '\w+' "
     r'\(strict_layout_map\); the nearest paths: hidden/kernel'),
    (dict(strict_layout_map=True),
     r'--strict_layout_map without --mesh_shape: there is no layout map'),
    (dict(keep_joins=True),
     r'--keep_joins without --mesh_shape: there is no layout map'),
    (dict(gather_ahead=2),
     r'--gather_ahead without --mesh_shape: there is no layout map'),
    (dict(MESH, plan_tables=True, gather_ahead=-1),
     r'gather_ahead=-1: give a count of layers, 0 or more'),
])
def test_a_bad_mesh_stops_with_one_line(tmp_path, user_module, digits_dir,
                                        values, message):
  values = {k: v.format(module=user_module) if isinstance(v, str) else v
            for k, v in values.items()}
  before = sorted(tmp_path.rglob('*'))
  with flagsaver.flagsaver(model_dir=str(tmp_path / 'run'), clone_on_cpu=True,
                           data_dir=digits_dir, train_steps=1, **values):
    with pytest.raises(SystemExit, match=message) as refused:
      cli.main(['train.py'])
  assert isinstance(refused.value.code, str)
  assert '\n' not in str(refused.value)
  assert sorted(tmp_path.rglob('*')) == before
