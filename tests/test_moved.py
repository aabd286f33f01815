"""Every public name that moved still imports from its old place, with a
DeprecationWarning naming the new one, and is the new object.

The list is `tfmulti.moved.MOVED`: a name moved without an entry there
breaks users' imports, which the README's and docs' names (`test_docs`)
and this list guard between them.
"""

import importlib
import os
import sys
import warnings

import pytest

from tfmulti import moved


def _import_old(old):
  """`old` imported afresh, as a user's script would on its first use: a
  moved module's old file, or a package's moved attribute."""
  parent, _, name = old.rpartition('.')
  package = importlib.import_module(parent)
  if os.path.exists(os.path.join(os.path.dirname(package.__file__),
                                 name + '.py')):
    sys.modules.pop(old, None)
    return importlib.import_module(old)
  return getattr(package, name)


@pytest.mark.parametrize('old', sorted(moved.MOVED))
def test_a_moved_name_imports_from_its_old_place_and_warns(old):
  new = moved.MOVED[old]
  with pytest.warns(DeprecationWarning, match=new.replace('.', r'\.')):
    found = _import_old(old)
  assert found is moved.resolve(new)


def test_the_new_places_import_without_a_warning():
  with warnings.catch_warnings():
    warnings.simplefilter('error', DeprecationWarning)
    for new in moved.MOVED.values():
      moved.resolve(new)


def test_a_name_that_never_was_there_is_an_attribute_error():
  from tfmulti import deploy
  with pytest.raises(AttributeError, match='no attribute'):
    deploy.NoSuchThing  # noqa: B018
