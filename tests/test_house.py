"""The house's sizes, read from the source: short functions and classes,
few parameters (bench/ aside, whose commands are scripts).

A class over 250 lines, a function over 60, or a function but a
constructor over 8 parameters (self counted) fails here, naming it; so
does a `TowersModel` over 150: Keras's door holds Keras's methods and
drives the trainer through its contract, and what else it needs lives in
`fit`'s modules below it."""

import ast
import functools
import os

from tests.helpers import REPO

PACKAGE = os.path.join(REPO, 'tfmulti')
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 8
MAX_DOOR_LINES = 150  # TowersModel.


@functools.cache
def _definitions():
  """(path, node) of each class and function of the package (parsed
  once: every test here reads them)."""
  return tuple(_walk())


def _walk():
  for folder, _, files in os.walk(PACKAGE):
    if os.path.relpath(folder, PACKAGE).split(os.sep)[0] == 'bench':
      continue
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
          if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            yield os.path.relpath(path, REPO), node


def _parameters(function):
  a = function.args
  return (len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) +
          bool(a.vararg) + bool(a.kwarg))


def test_classes_and_functions_are_short():
  long = [f'{path}:{node.lineno} {node.name}'
          for path, node in _definitions()
          if node.end_lineno - node.lineno + 1 > (
              MAX_CLASS_LINES if isinstance(node, ast.ClassDef)
              else MAX_FUNCTION_LINES)]
  assert not long, long


def test_keras_s_door_is_a_door():
  (door,) = [node for path, node in _definitions()
             if node.name == 'TowersModel' and isinstance(node, ast.ClassDef)]
  assert door.end_lineno - door.lineno + 1 <= MAX_DOOR_LINES


def test_only_constructors_take_more_than_eight_parameters():
  many = [f'{path}:{node.lineno} {node.name}'
          for path, node in _definitions()
          if isinstance(node, ast.FunctionDef) and node.name != '__init__'
          and _parameters(node) > MAX_PARAMETERS]
  assert not many, many


def test_the_reader_sees_what_it_judges():
  found = {node.name for path, node in _definitions()
           if path.endswith(os.path.join('deploy', 'towers.py'))}
  assert {'DeployedModel', 'deploy', 'compose'} <= found
