"""A model's own step traced on every clone in turn, meeting at each update.

A Keras model with its own `train_step` (keras.io's trainer pattern, a GAN,
a VAE) computes its gradients and applies them itself, once or several
times a step (a GAN's discriminator, then its generator, which reads the
discriminator as updated). tf.distribute runs such a step in each replica
on a thread of its own and meets the replicas inside `apply_gradients`
(`merge_call`). `run` does the same for the towers' clones, inside one
`tf.function` trace: each clone's step runs on a thread of its own, under
its device and name scope, one thread at a time in clone order; a clone
that calls an optimizer's `apply` (or `apply_gradients`) waits there until
every clone has reached that call; then `meet(optimizer, per_clone)` runs
once on the tracing thread (the towers' sum beside the variables, one
update) and the clones go on, in order, reading the updated variables.

Threads only order the tracing (never two at once); the ops they make are
one graph, which TensorFlow's automatic control dependencies order by the
order they were made in: a clone's reads after an update see it, and the
metrics each clone updates add up.
"""

import contextlib
import threading

import keras
import tensorflow as tf

from tfmulti import errors

# How long one clone's turn may take to trace, to its next update or end.
TURN_SECONDS = 600
STUCK = ('clone {clone} traced its step for {seconds} s without reaching an '
         'update or its end: does a tf.function inside the step apply the '
         'gradients? Apply them in the step itself')
DIVERGED = ("the clones' own steps diverged: clone {clone} {did} while "
            "clone 0 {first}; a step must call the same optimizers in the "
            'same order on every clone')


class _Clone(threading.Thread):
  """One clone's step on its thread, run a turn at a time."""

  def __init__(self, index, step, graph, device, scope):
    super().__init__(daemon=True, name=f'tfmulti-clone-{index}')
    self.index = index
    self.step = step
    self.graph = graph
    self.device = device
    self.scope = scope
    self.go = threading.Event()
    self.stopped = threading.Event()
    self.request = None  # (optimizer, grads, variables) at a meeting.
    self.answer = None
    self.result = None
    self.error = None
    self.done = False

  def run(self):
    self.go.wait()
    try:
      if self.error is None:  # Else released before its first turn.
        with self.graph.as_default(), tf.device(self.device), tf.name_scope(
            self.scope):
          self.result = self.step()
    except BaseException as e:  # noqa: B036  Handed to the tracing thread.
      self.error = e
    finally:
      self.done = True
      self.stopped.set()

  def meet(self, optimizer, grads, variables):
    """Waits, on this clone's thread, for the others to reach the same
    update; returns what the update returned."""
    if self.error is not None:  # Released: no more meetings.
      raise self.error
    self.request = (optimizer, list(grads), list(variables))
    self.go.clear()
    self.stopped.set()
    self.go.wait()
    if self.error is not None:  # Another clone failed: stop here too.
      raise self.error
    return self.answer

  def turn(self):
    """Lets this clone run until it meets or ends (`TURN_SECONDS` at
    most: a clone that never gets there is waiting on something else)."""
    self.stopped.clear()
    self.go.set()
    if not self.stopped.wait(TURN_SECONDS):
      raise errors.ConfigError(STUCK.format(clone=self.index,
                                            seconds=TURN_SECONDS))


@contextlib.contextmanager
def meetings(optimizers):
  """Inside, each of `optimizers`' `apply` (which `apply_gradients` calls)
  makes a clone's thread wait for the others (`_Clone.meet`); called on
  any other thread it applies as before (`apply`)."""
  for optimizer in optimizers:
    def meeting(grads, trainable_variables=None, optimizer=optimizer):
      clone = threading.current_thread()
      if not isinstance(clone, _Clone):
        return apply(optimizer, grads, trainable_variables)
      return clone.meet(optimizer, grads,
                        _variables(optimizer, grads, trainable_variables))
    optimizer.apply = meeting
  try:
    yield
  finally:
    for optimizer in optimizers:
      del optimizer.apply  # The class's own again.


def _variables(optimizer, grads, trainable_variables):
  """The variables an `apply(grads, trainable_variables)` updates, as
  Keras's `apply` takes them (None: those it was built for); raises
  `ValueError` where Keras would."""
  grads = list(grads)
  if trainable_variables is None:
    if not optimizer.built:
      raise ValueError(
          f'{optimizer.name}.apply(grads) with no trainable_variables: the '
          'optimizer is not built; pass the variables, as Keras asks.')
    trainable_variables = optimizer._trainable_variables  # pylint: disable=protected-access
  trainable_variables = list(trainable_variables)
  if len(grads) != len(trainable_variables):
    raise ValueError(
        f'{optimizer.name}.apply: {len(grads)} gradients for '
        f'{len(trainable_variables)} variables.')
  return trainable_variables


def apply(optimizer, grads, trainable_variables):
  """`optimizer`'s own `apply`, whatever `meetings` put in its place."""
  return type(optimizer).apply(optimizer, grads, trainable_variables)


def optimizers_of(model):
  """The Keras optimizers `model` holds as attributes (its `optimizer`, a
  GAN's two), in attribute order, each once."""
  found = {}
  for value in vars(model).values():
    if isinstance(value, keras.optimizers.Optimizer):
      found.setdefault(id(value), value)
  return list(found.values())


def run(steps, devices, scopes, meet):
  """Runs `steps` (one callable a clone) in turn, on `devices` under
  `scopes`, meeting at each update; returns each step's result.

  Call it while tracing a `tf.function`, inside `meetings` of the
  optimizers the steps apply. `meet(optimizer, requests)`, on this
  thread, gets [(grads, variables)] (one a clone, in clone order) of the
  same optimizer's update and returns what `apply` returns.

  Raises:
    errors.ConfigError: the clones called different updates.
    Whatever a clone's step raised.
  """
  graph = tf.compat.v1.get_default_graph()
  clones = [_Clone(i, step, graph, device, scope)
            for i, (step, device, scope) in enumerate(zip(steps, devices,
                                                          scopes))]
  for clone in clones:
    clone.start()
  try:
    while True:
      for clone in clones:
        if not clone.done:
          clone.turn()
        if clone.error is not None:
          raise clone.error
      if all(clone.done for clone in clones):
        return [clone.result for clone in clones]
      optimizer = _same_update(clones)
      answer = meet(optimizer, [c.request[1:] for c in clones])
      for clone in clones:
        clone.answer, clone.request = answer, None
  finally:
    _release(clones)


def _same_update(clones):
  """The optimizer every clone waits to update; `ConfigError` if they
  differ (or some ended while others wait)."""
  first = clones[0]
  for clone in clones[1:]:
    if clone.done != first.done or (
        not clone.done and (clone.request[0] is not first.request[0] or [
            id(v) for v in clone.request[2]] != [
                id(v) for v in first.request[2]])):
      raise errors.ConfigError(DIVERGED.format(
          clone=clone.index, did=_what(clone), first=_what(first)))
  return first.request[0]


def _what(clone):
  return ('ended' if clone.done else
          f'updates {len(clone.request[2])} variables with '
          f'{clone.request[0].name!r}')


def _release(clones):
  """Ends the threads still waiting (after a failure): each raises."""
  stop = errors.ConfigError('another clone failed')
  for clone in clones:
    clone.error = clone.error or stop
    while not clone.done:  # Each meeting it reaches now raises.
      clone.turn()
    clone.join()
