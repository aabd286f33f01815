"""A mesh row as one clone spanning its devices: where a layout computes
split kernels as blocks, each mesh row's leader takes the row's rows and
traces the model once for the row, each block on its device; the row's
other clones take no rows (`sharding.leaders`, `balance.OnLeaders`)."""

import keras
import numpy as np
import pytest

from tests.mesh import meshes
from tfmulti import fit
from tfmulti import layouts
from tfmulti.deploy import balance
from tfmulti.mesh import sharding


@pytest.mark.parametrize('shape, axes, want', [
    ((2, 4), {1}, (0, 0, 0, 0, 4, 4, 4, 4)),
    ((1, 4), {1}, (0, 0, 0, 0)),
    ((2, 2, 2), {1}, (0, 1, 0, 1, 4, 5, 4, 5)),
    ((2, 2, 2), {1, 2}, (0, 0, 0, 0, 4, 4, 4, 4)),
    ((2, 2), set(), (0, 1, 2, 3)),  # No split: every clone its own.
])
def test_each_device_s_leader_is_its_row_s_at_coordinate_0(shape, axes,
                                                            want):
  assert sharding.leaders(shape, axes) == want


@pytest.mark.parametrize('own, want', [
    (None, (2, 0, 2, 0)),  # Equal shares: each leader its row's two.
    ((3, 1, 2, 2), (4, 0, 4, 0)),
])
def test_a_policy_s_shares_are_gathered_on_the_leaders(own, want):
  policy = balance.OnLeaders(balance.Fixed(own), (0, 0, 2, 2))
  assert policy.shares(None, None, rows=16, current=None) == want
  assert policy.measured()


def test_clones_of_no_share_take_no_rows_and_others_must_take_some():
  layout = layouts.step_layout(16, layouts.Cut(num_clones=4,
                                               shares=(2, 0, 2, 0)))
  assert [p.rows for p in layout.pieces] == [8, 0, 8, 0]
  assert [p.offset for p in layout.pieces] == [0, 8, 8, 16]
  with pytest.raises(Exception, match='leaves clone 2 of 4 no rows'):
    layouts.step_layout(1, layouts.Cut(num_clones=4, shares=(2, 0, 2, 0)))


class Counting(keras.layers.Layer):
  """Counts the traces of its call (a step traced once a clone with rows
  calls it once a clone)."""
  calls = 0

  def call(self, x):
    Counting.calls += 1
    return x


def _model():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((6,))
  x = Counting()(keras.layers.Dense(8, name='inner')(inputs))
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


def _fit_counting(data, layout):
  """(plain `fit`'s losses, the towers', Counting's calls in the towers'
  `fit`, the towers) under `layout` on a mesh (2, 2)."""
  plain = _model()
  want = meshes.fit_model(plain, data, epochs=1)
  model = _model()
  towers = fit.TowersModel(model, meshes.parallel(layout))
  Counting.calls = 0
  got = meshes.fit_model(towers, data, epochs=1)
  for trained, wanted in zip(model.weights, plain.weights):
    np.testing.assert_allclose(trained, wanted, rtol=1e-5, atol=1e-6)
  return want, got, Counting.calls, towers


@pytest.mark.slow
def test_the_model_is_traced_once_a_mesh_row_and_trains_as_one_device():
  """On a mesh (2, 2) whose 'inner' kernel splits over 'model', the step
  traces the model once a row, two fewer times than when no kernel
  splits (one a clone: a kernel split over 'batch' alone is storage);
  the rows go to clones 0 and 2; both train as plain `fit`."""
  rng = np.random.default_rng(0)
  data = (rng.normal(size=(32, 6)).astype('float32'),
          rng.integers(0, 2, 32).astype('int32'))
  want, got, split_calls, towers = _fit_counting(
      data, {'.*inner/kernel': (None, 'model')})
  np.testing.assert_allclose(got, want, rtol=1e-5)
  layout = towers.towers.layout_for(data[0][:16], data[1][:16])
  assert [p.rows for p in layout.pieces] == [8, 0, 8, 0]
  want, got, whole_calls, towers = _fit_counting(
      data, {'.*inner/kernel': (None, 'batch')})
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert not towers.towers.parts.storage.splits
  assert split_calls == whole_calls - 2
