"""`python -m tfmulti.compare RUN_A RUN_B`: two layouts under reproducible
rows agree bit for bit; two runs that differ are said to, with a non-zero
exit; a folder without a run stops in one line."""

import pytest

from tfmulti import compare


def _compare(capsys, *argv):
  with pytest.raises(SystemExit) as done:
    compare.main(list(argv))
  out, err = capsys.readouterr()
  return done.value.code, out.splitlines(), err


@pytest.mark.slow
def test_two_layouts_agree_and_two_rates_differ(run_train, tmp_path,
                                                capsys):
  """One clone of 8 rows and two of 4, atoms of 2 rows: the same bits;
  another learning rate: its losses and weights differ."""
  runs = {name: str(tmp_path / name) for name in ('one', 'two', 'other')}
  common = dict(reproducible_rows=2, train_steps=3, optimizer='sgd')
  run_train(model_dir=runs['one'], num_clones=1, batch_size=8, **common)
  run_train(model_dir=runs['two'], num_clones=2, batch_size=4, **common)
  run_train(model_dir=runs['other'], num_clones=2, batch_size=4,
            learning_rate=0.05, **common)
  code, lines, _ = _compare(capsys, runs['one'], runs['two'])
  assert code == 0, lines
  assert len(lines) == 1 and lines[0].startswith(
      'agree: 3 logged losses and the ')
  assert lines[0].endswith('tensors of the checkpoints at step 3, bit for '
                           'bit')
  code, lines, _ = _compare(capsys, runs['one'], runs['other'])
  assert code == 1
  assert lines[0].startswith('step 2: loss ')  # Step 1: the same start.
  assert any('differs by up to' in line for line in lines), lines
  assert lines[-1].startswith('differ: ')


def test_a_folder_without_a_run_stops_with_one_line(tmp_path, capsys):
  code, lines, err = _compare(capsys, str(tmp_path), str(tmp_path))
  assert code == 2 and not lines
  assert err.count('\n') == 1
  assert err.startswith('python -m tfmulti.compare: error: ')
  assert 'holds no readable job.json' in err
