"""The house's sizes, read from the source: short functions and classes,
few parameters (bench/ aside, whose commands are scripts).

Sizes count code lines: a line with a token of code, not a docstring, a
comment or a blank (rewording a docstring never meets a limit). A class
over 200 code lines, a function over 60, or a function but a constructor
over 8 parameters (self counted) fails here, naming it; so does a
`TowersModel` over 100: Keras's door holds Keras's methods and drives the
trainer through its contract, and what else it needs lives in `fit`'s
modules below it."""

import ast
import functools
import io
import os
import tokenize

from tests.helpers import REPO

PACKAGE = os.path.join(REPO, 'tfmulti')
MAX_CLASS_LINES = 200
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 8
MAX_DOOR_LINES = 100  # TowersModel.
_NOT_CODE = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
             tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)


@functools.cache
def _definitions():
  """(path, node, code lines) of each class and function of the package
  (parsed once: every test here reads them)."""
  return tuple(_walk())


def _walk():
  for folder, _, files in os.walk(PACKAGE):
    if os.path.relpath(folder, PACKAGE).split(os.sep)[0] == 'bench':
      continue
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        source = open(path).read()
        tree = ast.parse(source)
        code = _code_lines(source, tree)
        for node in ast.walk(tree):
          if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            yield os.path.relpath(path, REPO), node, len(
                code & set(range(node.lineno, node.end_lineno + 1)))


def _code_lines(source, tree):
  """The numbers of `source`'s lines that hold code: a token that is no
  comment, and no docstring's."""
  docstrings = set()
  for node in ast.walk(tree):
    body = getattr(node, 'body', None)
    if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)):
      docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
  lines = set()
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type not in _NOT_CODE:
      lines.update(range(token.start[0], token.end[0] + 1))
  return lines - docstrings


def _parameters(function):
  a = function.args
  return (len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) +
          bool(a.vararg) + bool(a.kwarg))


def test_classes_and_functions_are_short():
  long = [f'{path}:{node.lineno} {node.name} ({code} code lines)'
          for path, node, code in _definitions()
          if code > (MAX_CLASS_LINES if isinstance(node, ast.ClassDef)
                     else MAX_FUNCTION_LINES)]
  assert not long, long


def test_keras_s_door_is_a_door():
  (code,) = [code for path, node, code in _definitions()
             if node.name == 'TowersModel' and isinstance(node, ast.ClassDef)]
  assert code <= MAX_DOOR_LINES


def test_code_lines_leave_out_docstrings_and_comments():
  source = ('def f():\n  """Says what.\n\n  And why."""\n  # A comment.\n'
            '  return (1 +\n          2)\n')
  assert _code_lines(source, ast.parse(source)) == {1, 6, 7}


def test_only_constructors_take_more_than_eight_parameters():
  many = [f'{path}:{node.lineno} {node.name}'
          for path, node, _ in _definitions()
          if isinstance(node, ast.FunctionDef) and node.name != '__init__'
          and _parameters(node) > MAX_PARAMETERS]
  assert not many, many


def test_the_reader_sees_what_it_judges():
  found = {node.name for path, node, _ in _definitions()
           if path.endswith(os.path.join('deploy', 'towers.py'))}
  assert {'DeployedModel', 'deploy', 'compose'} <= found


def test_no_behaviour_is_keyed_on_a_threads_identity():
  """State is passed, not read from the thread a call runs on (a layer's
  replaced call is keyed by its tf.distribute replica)."""
  keyed = [f'{path}:{node.lineno}' for path, node in _nodes()
           if isinstance(node, ast.Attribute) and node.attr == 'get_ident']
  assert not keyed, keyed


def _nodes():
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        for node in ast.walk(ast.parse(open(path).read())):
          yield os.path.relpath(path, REPO), node
