"""The models Keras users bring train as plain `fit` trains them on one
device: Sequential and subclassed models, and embeddings whose gradients
are `tf.IndexedSlices` (under Adam, which applies each slice)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import L2
from tfmulti import deploy
from tfmulti import errors
from tfmulti import fit
from tfmulti.deploy import towers

ROWS, BATCH, VOCAB, TOKENS = 48, 16, 40, 6


def _sequential(seed=0):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input((6,)),
      keras.layers.Dense(16, activation='tanh',
                         kernel_regularizer=keras.regularizers.L2(L2)),
      keras.layers.Dense(3)])


class _Classifier(keras.Model):
  """A subclassed model, as Keras's guide writes one (a leading '_' in
  its class name too, which Keras's own `fit` cannot name a scope after:
  its reference is named apart)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.hidden = keras.layers.Dense(
        16, activation='tanh', kernel_regularizer=keras.regularizers.L2(L2))
    self.logits = keras.layers.Dense(3)

  def call(self, inputs):
    return self.logits(self.hidden(inputs))


def _subclassed(seed=0, **kwargs):
  keras.utils.set_random_seed(seed)
  model = _Classifier(**kwargs)
  model(np.zeros((1, 6), np.float32))  # Built as Keras's guide builds it.
  return model


def _named_subclassed():
  return _subclassed(name='classifier')


def _embedding(seed=0):
  """Token ids -> an Embedding (a sparse gradient: each looked-up row a
  slice, the frequent ids looked up several times a batch) -> logits."""
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((TOKENS,), dtype='int32')
  x = keras.layers.Embedding(VOCAB, 8)(inputs)
  x = keras.layers.GlobalAveragePooling1D()(x)
  return keras.Model(inputs, keras.layers.Dense(3)(x))


def _transformer(seed=0):
  """A Transformer block as text models build one: an Embedding, self-
  attention with a residual and LayerNormalization, pooled to logits."""
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((TOKENS,), dtype='int32')
  x = keras.layers.Embedding(VOCAB, 8)(inputs)
  attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(x, x)
  x = keras.layers.LayerNormalization()(x + attended)
  x = keras.layers.GlobalAveragePooling1D()(x)
  return keras.Model(inputs, keras.layers.Dense(3)(x))


def _gru(seed=0):
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((TOKENS,), dtype='int32')
  x = keras.layers.Embedding(VOCAB, 8)(inputs)
  return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GRU(8)(x)))


def _categorical_beside_float(seed=0):
  """A recommender's input: an id through an Embedding beside features."""
  keras.utils.set_random_seed(seed)
  ids = keras.Input((1,), dtype='int32', name='ids')
  features = keras.Input((6,), name='features')
  x = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 4)(ids))
  x = keras.layers.Concatenate()([x, keras.layers.Dense(4)(features)])
  return keras.Model({'ids': ids, 'features': features},
                     keras.layers.Dense(3)(x))


class _TiedLogits(keras.layers.Layer):
  """Logits over the vocabulary from the input Embedding's own table."""

  def __init__(self, embedding, **kwargs):
    super().__init__(**kwargs)
    self.embedding = embedding

  def call(self, x):
    return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))


def _tied(seed=0):
  """One table read twice: by a gather (slices) and a matmul (dense); on
  one device too, the tape adds the two into one dense gradient."""
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((TOKENS,), dtype='int32')
  embedding = keras.layers.Embedding(VOCAB, 8)
  x = keras.layers.GlobalAveragePooling1D()(embedding(inputs))
  return keras.Model(inputs, _TiedLogits(embedding)(x))


class _TokenAndPositionEmbedding(keras.layers.Layer):
  """keras.io's text transformer's embedding: the positions looked up
  by `arange`, once a batch, not per row."""

  def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
    super().__init__(**kwargs)
    self.token_emb = keras.layers.Embedding(vocab_size, embed_dim)
    self.pos_emb = keras.layers.Embedding(maxlen, embed_dim)

  def call(self, x):
    maxlen = keras.ops.shape(x)[-1]
    positions = self.pos_emb(keras.ops.arange(start=0, stop=maxlen, step=1))
    return self.token_emb(x) + positions


def _positions(seed=0):
  """keras.io's text classification with a Transformer, small."""
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((TOKENS,), dtype='int32')
  x = _TokenAndPositionEmbedding(TOKENS, VOCAB, 8)(inputs)
  attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(x, x)
  x = keras.layers.LayerNormalization(epsilon=1e-6)(x + attended)
  x = keras.layers.GlobalAveragePooling1D()(x)
  x = keras.layers.Dense(8, activation='relu')(x)
  return keras.Model(inputs, keras.layers.Dense(3)(x))


def _token_and_position(seed=0):
  """The same embedding, pooled to logits."""
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((TOKENS,), dtype='int32')
  x = _TokenAndPositionEmbedding(TOKENS, VOCAB, 8)(inputs)
  x = keras.layers.GlobalAveragePooling1D()(x)
  return keras.Model(inputs, keras.layers.Dense(3)(x))


def _features():
  rng = np.random.default_rng(3)
  return (rng.normal(size=(ROWS, 6)).astype(np.float32),
          rng.integers(0, 3, size=ROWS).astype(np.int32))


def _tokens():
  rng = np.random.default_rng(4)
  # Few ids: every batch looks some up several times.
  return (rng.integers(0, 12, size=(ROWS, TOKENS)).astype(np.int32),
          rng.integers(0, 3, size=ROWS).astype(np.int32))


def _ids_and_features():
  rng = np.random.default_rng(5)
  return ({'ids': rng.integers(0, 12, size=(ROWS, 1)).astype(np.int32),
           'features': rng.normal(size=(ROWS, 6)).astype(np.float32)},
          rng.integers(0, 3, size=ROWS).astype(np.int32))


def _next_tokens():
  images, _ = _tokens()
  return images, images[:, 0]  # Over the vocabulary: the tied logits'.


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _plain(model_fn, data, optimizer):
  model = model_fn()
  model.compile(optimizer=optimizer(), loss=_loss())
  model.fit(*data, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
  return model


def _towers(model_fn, data, optimizer, num_clones=2, num_stages=1,
            steps_per_execution=1, **options):
  config = deploy.DeploymentConfig(num_clones=num_clones, clone_on_cpu=True,
                                   num_stages=num_stages)
  with config.variables_scope():
    model = model_fn()
  towers = fit.TowersModel(model, config, **options)
  towers.compile(optimizer=optimizer(), loss=_loss(),
                 steps_per_execution=steps_per_execution)
  towers.fit(*data, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
  return towers.model


def _assert_same_weights(got, want, inputs=None):
  """Every weight equal to 1e-5, but an attention key bias: its true
  gradient is 0, so Adam moves it by normalised round-off on one device
  too; it shifts every attention logit of a query alike, so the outputs
  on `inputs` must agree instead."""
  apart = [v.path for v in want.weights if v.path.endswith('key/bias')]
  for g, w in zip(got.weights, want.weights):
    if w.path not in apart:
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)
  if apart:
    np.testing.assert_allclose(got.predict(inputs, verbose=0),
                               want.predict(inputs, verbose=0),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('model_fn, plain_fn', [
    (_sequential, _sequential), (_subclassed, _named_subclassed)])
def test_sequential_and_subclassed_models_train_as_plain_fit(model_fn,
                                                             plain_fn):
  adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
  want = _plain(plain_fn, _features(), adam)
  got = _towers(model_fn, _features(), adam)
  _assert_same_weights(got, want)
  # The towers trained the user's own object, of the user's own class.
  assert type(got) is type(model_fn())


@pytest.mark.slow
@pytest.mark.parametrize('options', [
    dict(clone_shares=(3, 1)), dict(accumulation_steps=2),
    dict(reproducible_rows=4)], ids=lambda o: ','.join(o))
@pytest.mark.parametrize('model_fn, plain_fn', [
    (_sequential, _sequential), (_subclassed, _named_subclassed)])
def test_sequential_and_subclassed_models_on_every_layout(model_fn, plain_fn,
                                                         options):
  adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
  want = _plain(plain_fn, _features(), adam)
  got = _towers(model_fn, _features(), adam, **options)
  _assert_same_weights(got, want)


@pytest.mark.slow
@pytest.mark.parametrize('model_fn, plain_fn', [
    (_sequential, _sequential), (_subclassed, _named_subclassed)])
def test_sequential_and_subclassed_models_with_spread_variables(model_fn,
                                                                plain_fn):
  adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
  want = _plain(plain_fn, _features(), adam)
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True,
                                   variables_device='spread')
  with config.variables_scope():
    model = model_fn()
  towers = fit.TowersModel(model, config)
  towers.compile(optimizer=adam(), loss=_loss())
  towers.fit(*_features(), batch_size=BATCH, epochs=2, shuffle=False,
             verbose=0)
  _assert_same_weights(towers.model, want)


def test_a_subclassed_model_is_refused_stages_in_one_line():
  config = deploy.DeploymentConfig(num_clones=1, num_stages=2,
                                   clone_on_cpu=True)
  with config.variables_scope():
    model = _subclassed()
  towers = fit.TowersModel(model, config, num_microbatches=2)
  with pytest.raises(errors.ConfigError,
                     match='no graph of layers to cut into stages'):
    towers.compile(optimizer='sgd', loss=_loss())


def test_an_unbuilt_subclassed_model_is_refused_in_one_line():
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with pytest.raises(errors.ConfigError,
                     match=r'a first call on a batch \(model\(x\)\)'):
    fit.TowersModel(_Classifier(), config)


@pytest.mark.parametrize('optimizer', [
    pytest.param(lambda: keras.optimizers.Adam(0.05), id='adam'),
    pytest.param(lambda: keras.optimizers.SGD(0.5), id='sgd',
                 marks=pytest.mark.slow),
    pytest.param(lambda: keras.optimizers.RMSprop(0.01), id='rmsprop',
                 marks=pytest.mark.slow),
    pytest.param(lambda: keras.optimizers.Adagrad(0.1), id='adagrad',
                 marks=pytest.mark.slow),
    pytest.param(lambda: keras.optimizers.AdamW(0.05), id='adamw',
                 marks=pytest.mark.slow)])
def test_an_embedding_trains_as_plain_fit(optimizer):
  """Keras applies an Embedding's gradient slice by slice; the towers hand
  the optimizer the slices one device would (not their dense sum)."""
  want = _plain(_embedding, _tokens(), optimizer)
  got = _towers(_embedding, _tokens(), optimizer)
  _assert_same_weights(got, want)


def _dropout(seed=0):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input((6,)), keras.layers.Dense(16, activation='tanh'),
      keras.layers.Dropout(0.5), keras.layers.Dense(3)])


@pytest.mark.parametrize('model_fn, plain_fn, data', [
    (_sequential, _sequential, _features),
    pytest.param(_subclassed, _named_subclassed, _features,
                 marks=pytest.mark.slow),
    (_embedding, _embedding, _tokens)],
                         ids=['sequential', 'subclassed', 'embedding'])
def test_models_a_user_brings_train_as_plain_fit_many_steps_a_call(
    model_fn, plain_fn, data):
  """compile(steps_per_execution=3) under Adam (an Embedding's slices
  applied one by one, as Keras's own): plain one-device fit's weights."""
  adam = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
  want = _plain(plain_fn, data(), adam)
  got = _towers(model_fn, data(), adam, steps_per_execution=3)
  _assert_same_weights(got, want)


@pytest.mark.slow
def test_dropout_many_steps_a_call_draws_the_masks_of_one_a_call():
  """Dropout's masks differ from one device's (each clone draws its
  own), but a compiled loop of 3 steps draws those of one step a call:
  the same bits."""
  sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
  one = _towers(_dropout, _features(), sgd)
  many = _towers(_dropout, _features(), sgd, steps_per_execution=3)
  for got, want in zip(many.weights, one.weights):
    np.testing.assert_array_equal(got, want, err_msg=want.path)


@pytest.mark.parametrize('model_fn, data', [
    pytest.param(_transformer, _tokens, marks=pytest.mark.slow),
    pytest.param(_gru, _tokens, marks=pytest.mark.slow),
    (_categorical_beside_float, _ids_and_features),
    pytest.param(_tied, _next_tokens, marks=pytest.mark.slow)],
                         ids=['transformer', 'gru', 'categorical', 'tied'])
def test_text_and_recommender_models_train_as_plain_fit(model_fn, data):
  adam = lambda: keras.optimizers.Adam(0.02)  # noqa: E731
  want = _plain(model_fn, data(), adam)
  got = _towers(model_fn, data(), adam)
  _assert_same_weights(got, want, data()[0])


@pytest.mark.slow
@pytest.mark.parametrize('config_fields, options', [
    (dict(num_clones=2, num_stages=2), dict(num_microbatches=2)),
    (dict(num_clones=2, num_stages=2),
     dict(num_microbatches=2, pipeline_schedule='zb_h1')),
    (dict(num_clones=2, num_stages=2),
     dict(num_microbatches=4, pipeline_schedule='zb_v')),
    (dict(num_clones=2, variables_device='spread'), {}),
    (dict(num_clones=2), dict(reproducible_rows=4, accumulation_steps=2)),
], ids=['stages', 'zb_h1', 'zb_v', 'spread', 'reproducible-accumulation'])
def test_a_transformer_trains_as_plain_fit_on_every_layout(config_fields,
                                                           options):
  adam = lambda: keras.optimizers.Adam(0.02)  # noqa: E731
  want = _plain(_transformer, _tokens(), adam)
  config = deploy.DeploymentConfig(clone_on_cpu=True, **config_fields)
  with config.variables_scope():
    model = _transformer()
  towers = fit.TowersModel(model, config, **options)
  towers.compile(optimizer=adam(), loss=_loss())
  towers.fit(*_tokens(), batch_size=BATCH, epochs=2, shuffle=False,
             verbose=0)
  _assert_same_weights(towers.model, want, _tokens()[0])


@pytest.mark.slow
@pytest.mark.parametrize('model_fn, data', [
    (_gru, _tokens), (_tied, _next_tokens)], ids=['gru', 'tied'])
def test_a_split_backward_pass_trains_loops_and_tied_tables_as_plain_fit(
    model_fn, data):
  """Under ZB-H1, B holds back for W only the ops that the weights'
  gradients alone need: a GRU's backward loop (one op for its input and
  weight gradients) stays in B, a table read twice gets both reads."""
  adam = lambda: keras.optimizers.Adam(0.02)  # noqa: E731
  want = _plain(model_fn, data(), adam)
  got = _towers(model_fn, data(), adam, num_clones=1, num_stages=2,
                num_microbatches=2, pipeline_schedule='zb_h1')
  _assert_same_weights(got, want, data()[0])


@pytest.mark.slow
@pytest.mark.parametrize('options', [
    dict(num_clones=4),
    dict(num_clones=2, clone_shares=(3, 1)),
    dict(num_clones=2, accumulation_steps=2),
    dict(num_clones=2, reproducible_rows=4),
    dict(num_clones=2, gradient_packs=1),
], ids=lambda options: ','.join(f'{k}={v}' for k, v in options.items()))
def test_an_embedding_trains_as_plain_fit_on_every_layout(options):
  adam = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
  want = _plain(_embedding, _tokens(), adam)
  got = _towers(_embedding, _tokens(), adam, **options)
  _assert_same_weights(got, want)


def test_the_optimizer_receives_an_embeddings_slices_not_a_dense_sum():
  """What the step hands `apply_gradients`: the table's gradient as
  slices, one a looked-up row of the whole batch, as on one device."""
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with tf.device(config.variables_device()):
    model = _embedding()
    optimizer = keras.optimizers.Adam(0.05)
  towers = deploy.deploy(config, model, _loss(), optimizer)
  seen = []
  apply = optimizer.apply_gradients

  def spy(grads_and_vars):
    grads_and_vars = list(grads_and_vars)
    seen.extend(grads_and_vars)
    return apply(grads_and_vars)
  optimizer.apply_gradients = spy
  images, labels = _tokens()
  towers.traced_step(images[:BATCH], labels[:BATCH])
  table = model.layers[1].embeddings
  gradient, = [g for g, v in seen if v is table]
  assert isinstance(gradient, tf.IndexedSlices)
  assert gradient.values.shape == (BATCH * TOKENS, 8)


@pytest.mark.slow
def test_reproducible_rows_take_keras_s_default_shuffle_of_arrays():
  """Op determinism (on with reproducible rows) refuses Keras's unseeded
  shuffle; the arrays come in each epoch's order from `shuffle_seed`
  instead: the same bits on 2 and 4 clones, with shuffling."""
  sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
  trained = []
  for num_clones in (2, 4):
    config = deploy.DeploymentConfig(num_clones=num_clones,
                                     clone_on_cpu=True)
    with config.variables_scope():
      model = _sequential()
    tf.random.set_seed(None)  # No seed for Keras's own shuffle.
    towers = fit.TowersModel(model, config, reproducible_rows=4)
    towers.compile(optimizer=sgd(), loss=_loss())
    towers.fit(*_features(), batch_size=BATCH, epochs=2, verbose=0)
    trained.append(model)
  for got, want in zip(*(model.weights for model in trained)):
    np.testing.assert_array_equal(got, want, err_msg=want.path)
  in_order = _towers(_sequential, _features(), sgd, reproducible_rows=4)
  assert not np.array_equal(in_order.weights[0], trained[0].weights[0])


def _batch_norm(synchronized=(True, True), seed=0):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input((6,)), keras.layers.Dense(8),
      keras.layers.BatchNormalization(synchronized=synchronized[0]),
      keras.layers.Activation('relu'), keras.layers.Dense(8),
      keras.layers.BatchNormalization(synchronized=synchronized[1]),
      keras.layers.Dense(3)])


@pytest.mark.slow
def test_a_models_own_synchronized_batch_norm_is_synchronized():
  """BatchNormalization(synchronized=True), with no option: statistics of
  the whole batch, as plain fit's on one device (each clone's own were
  0.0187 off after a step)."""
  sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
  want = _plain(_batch_norm, _features(), sgd)
  got = _towers(_batch_norm, _features(), sgd)
  assert got.layers[1].synchronized  # The user's model as they built it.
  _assert_same_weights(got, want)


def test_partly_synchronized_batch_norm_is_refused_in_one_line():
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with config.variables_scope():
    model = _batch_norm(synchronized=(True, False))
  with pytest.raises(errors.ConfigError, match=(
      r'synchronizes BatchNormalization batch_normalization(_\d+)? but not '
      r'batch_normalization(_\d+)?: .* set synchronized=True on every one')):
    fit.TowersModel(model, config)
  with config.variables_scope():
    model = _batch_norm()
  with pytest.raises(errors.ConfigError,
                     match=r'pass sync_batch_norm=True \(--sync_batch_norm'):
    towers.build(config, model, _loss(), keras.optimizers.SGD(0.1),
                 deploy.StepOptions(xla=False))


@pytest.mark.slow
def test_positions_under_adam_train_as_plain_fit():
  """keras.io's text transformer: its positions are looked up by
  `arange`, once a batch; the optimizer gets one slice a position summed
  over the clones, as on one device (joined, Adam would square each
  clone's apart)."""
  adam = lambda: keras.optimizers.Adam(0.02)  # noqa: E731
  want = _plain(_positions, _tokens(), adam)
  got = _towers(_positions, _tokens(), adam)
  _assert_same_weights(got, want, _tokens()[0])


@pytest.mark.slow
@pytest.mark.parametrize('options', [
    dict(num_clones=4), dict(clone_shares=(3, 1)),
    dict(accumulation_steps=2), dict(reproducible_rows=4),
    dict(num_stages=2, num_microbatches=2),
    dict(num_stages=2, num_microbatches=2, pipeline_schedule='zb_h1'),
    dict(xla=True), dict(gradient_packs=1),
    dict(optimizer=lambda: keras.optimizers.AdamW(0.02)),
    dict(optimizer=lambda: keras.optimizers.RMSprop(0.01)),
    dict(optimizer=lambda: keras.optimizers.Adagrad(0.1)),
], ids=lambda o: ','.join(f'{k}={v}' for k, v in o.items()
                          if k != 'optimizer') or o['optimizer']().name)
def test_positions_train_as_plain_fit_on_every_layout(options):
  optimizer = options.pop(
      'optimizer', lambda: keras.optimizers.Adam(0.02))
  want = _plain(_positions, _tokens(), optimizer)
  got = _towers(_positions, _tokens(), optimizer, **options)
  _assert_same_weights(got, want, _tokens()[0])


@pytest.mark.slow
def test_positions_give_the_same_bits_on_every_layout_of_atoms():
  """Tokens and positions under Adam, with reproducible rows: the same
  bits on 2 clones, 4 clones, and 2 clones of 2 accumulation steps."""
  adam = lambda: keras.optimizers.Adam(0.02)  # noqa: E731
  two = _towers(_token_and_position, _tokens(), adam, reproducible_rows=4)
  for layout in (dict(num_clones=4), dict(accumulation_steps=2)):
    other = _towers(_token_and_position, _tokens(), adam,
                    reproducible_rows=4, **layout)
    for got, want in zip(other.weights, two.weights):
      np.testing.assert_array_equal(got, want, err_msg=want.path)


@pytest.mark.slow
def test_the_optimizer_receives_one_slice_a_position_and_a_token():
  """A lookup whose indices come from no row (positions) gives one slice
  a row for the batch; the tokens' lookup, one a looked-up row."""
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with tf.device(config.variables_device()):
    model = _positions()
    optimizer = keras.optimizers.Adam(0.05)
  towers = deploy.deploy(config, model, _loss(), optimizer,
                         deploy.StepOptions(accumulation_steps=2))
  seen = {}
  apply = optimizer.apply_gradients

  def spy(grads_and_vars):
    grads_and_vars = list(grads_and_vars)
    for g, v in grads_and_vars:  # What the step hands over, as it runs.
      if isinstance(g, tf.IndexedSlices):
        tf.py_function(lambda i, path=v.path: seen.update({path: i.numpy()}),
                       [g.indices], [])
    return apply(grads_and_vars)
  optimizer.apply_gradients = spy
  images, labels = _tokens()
  towers.train_step_outputs(images[:BATCH], labels[:BATCH])
  embedding = model.layers[1]
  np.testing.assert_array_equal(seen[embedding.pos_emb.embeddings.path],
                                np.arange(TOKENS))
  np.testing.assert_array_equal(seen[embedding.token_emb.embeddings.path],
                                images[:BATCH].ravel())


def _saturated(activation, units):
  """Probabilities of large logits (a sigmoid's or softmax's 0 and 1),
  which Keras's cross-entropy reads from the logits it keeps."""
  keras.utils.set_random_seed(0)
  return keras.Sequential([
      keras.Input((6,)), keras.layers.Dense(
          units, activation=activation,
          kernel_initializer=keras.initializers.RandomNormal(stddev=100.0))])


@pytest.mark.slow
@pytest.mark.parametrize('activation, units, loss, labels', [
    ('sigmoid', 1, 'binary_crossentropy', lambda y: (y > 0)[:, None]),
    ('softmax', 3, 'sparse_categorical_crossentropy', lambda y: y)])
def test_every_number_fit_logs_for_probabilities_is_plain_keras(
    activation, units, loss, labels):
  """A saturated sigmoid's or softmax's losses from the logits Keras
  keeps on its outputs: the training loss, the metric, `val_loss` and
  `evaluate` as plain Keras logs them (from probabilities alone, 6.98
  against 31.58)."""
  images, targets = _features()
  targets = labels(targets).astype(np.float32)
  fit_args = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  validation_data=(images[:BATCH], targets[:BATCH]))
  logged = []
  for model_fn in (lambda: _saturated(activation, units),
                   lambda: fit.TowersModel(_saturated(activation, units),
                                           deploy.DeploymentConfig(
                                               num_clones=2,
                                               clone_on_cpu=True))):
    model = model_fn()
    model.compile(optimizer=keras.optimizers.SGD(1e-4), loss=loss,
                  metrics=[loss])
    history = model.fit(images, targets, **fit_args).history
    logged.append((history, model.evaluate(images, targets, batch_size=BATCH,
                                           verbose=0)))
  (plain, plain_evaluation), (towers, evaluation) = logged
  assert plain['val_loss'][0] > 20  # Beyond what clipped probabilities give.
  for key, values in plain.items():
    np.testing.assert_allclose(towers[key], values, rtol=1e-5, err_msg=key)
  np.testing.assert_allclose(evaluation, plain_evaluation, rtol=1e-5)


class _CausalLM(keras.Model):
  """A causal LM as Keras-Hub builds one: a functional backbone (dict
  inputs: token ids and a padding mask) made in the subclass's
  `__init__`, which ends in the functional constructor."""

  def __init__(self, **kwargs):
    ids = keras.Input((TOKENS,), dtype='int32', name='token_ids')
    padding = keras.Input((TOKENS,), dtype='int32', name='padding_mask')
    x = keras.layers.Embedding(VOCAB, 8)(ids)
    causal = keras.ops.tril(keras.ops.ones((TOKENS, TOKENS), 'bool'))
    mask = keras.ops.logical_and(
        causal[None], keras.ops.cast(padding[:, None, :], 'bool'))
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(
        x, x, attention_mask=mask)
    x = keras.layers.LayerNormalization()(x + attended)
    logits = keras.layers.Dense(VOCAB)(x)
    super().__init__({'token_ids': ids, 'padding_mask': padding}, logits,
                     **kwargs)


def _causal_lm(seed=0):
  keras.utils.set_random_seed(seed)
  return _CausalLM(name='causal_lm')  # Keras's fit needs a root scope name.


def _lm_data():
  """Next-token labels a token, and per-token sample weights: 0 on the
  padding each row ends with."""
  rng = np.random.default_rng(6)
  ids = rng.integers(1, 12, size=(ROWS, TOKENS + 1)).astype(np.int32)
  lengths = rng.integers(2, TOKENS + 1, size=ROWS)
  padding = (np.arange(TOKENS)[None] < lengths[:, None]).astype(np.int32)
  return ({'token_ids': ids[:, :-1] * padding, 'padding_mask': padding},
          ids[:, 1:], padding.astype(np.float32))


@pytest.mark.slow
def test_a_keras_hub_style_causal_lm_trains_as_plain_fit():
  adam = lambda: keras.optimizers.Adam(0.02)  # noqa: E731
  x, y, weights = _lm_data()
  plain = _causal_lm()
  plain.compile(optimizer=adam(), loss=_loss())
  plain.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=2,
            shuffle=False, verbose=0)
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with config.variables_scope():
    model = _causal_lm()
  towers = fit.TowersModel(model, config)
  towers.compile(optimizer=adam(), loss=_loss())
  towers.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=2,
             shuffle=False, verbose=0)
  _assert_same_weights(towers.model, plain, x)


class _WithBatchNorm(keras.Model):
  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.hidden = keras.layers.Dense(16)
    self.norm = keras.layers.BatchNormalization()
    self.logits = keras.layers.Dense(3)

  def call(self, inputs, training=None):
    return self.logits(keras.activations.tanh(
        self.norm(self.hidden(inputs), training=training)))


def _subclassed_batch_norm():
  keras.utils.set_random_seed(0)
  model = _WithBatchNorm(name='with_batch_norm')
  model(np.zeros((1, 6), np.float32))
  return model


def test_a_subclassed_models_batch_norm_synchronizes_as_one_device():
  """Its BatchNormalization is reachable (a tracked attribute), so the
  clones normalise by the whole batch's statistics: plain fit's. (SGD:
  the bias before the BatchNorm has a true gradient of 0, which Adam would
  turn into normalised round-off.)"""
  sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
  want = _plain(_subclassed_batch_norm, _features(), sgd)
  got = _towers(_subclassed_batch_norm, _features(), sgd,
                sync_batch_norm=True)
  _assert_same_weights(got, want)
