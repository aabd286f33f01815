"""The README's command (`python train.py --num_clones=2 --clone_on_cpu`),
its first 20 steps, against the losses it logged once (the golden file
`tests/golden/readme_lenet_digits.json`, written by `python -m
tfmulti.compare RUN --write_golden=...` from `python train.py
--num_clones=2 --clone_on_cpu --train_steps=20 --log_every_steps=1
--noexport`), trained over other clone counts, stages and meshes: each
layout trains the same job on the same rows, so logs the same losses:
the README's `--clone_shares=auto` too, whatever shares it measures, for
the steps before round-off crosses a ReLU. Its split is timed, and splits
differ in round-off: at 2:14 or 6:10 one row's pre-activation of one unit
at step 11 is -8.8e-8 where 8:8 has +1.3e-8, so its gradient passes the
unit in one and not the other (docs/design.md, "Which number to
compare"). Each of the 15 splits of 16 logs the golden losses of steps 1
to 10 (2026-11-29); atoms make every split the same bits."""

import os

import pytest

from tfmulti import compare

GOLDEN = os.path.join(os.path.dirname(__file__), 'golden',
                      'readme_lenet_digits.json')
STEPS = 20
# The golden steps a layout's run is held to, where fewer than STEPS.
FIRST_STEPS = {'shares measured': 10}

# LeNet's Dense kernels split by their outputs over 'model': computed as
# blocks, a mesh row one clone spanning its devices.
SPLIT = """
import keras


def split(device_mesh):
  layouts = keras.distribution.LayoutMap(device_mesh)
  layouts['.*dense.*/kernel'] = (None, 'model')
  return layouts
"""

# Each the README's global batch of 128 rows (64 a clone, 2 clones).
LAYOUTS = {
    'the README': dict(num_clones=2, batch_size=64),
    'one clone': dict(num_clones=1, batch_size=128),
    'four clones': dict(num_clones=4, batch_size=32),
    # The README's second command: the clones' shares measured.
    'shares measured': dict(num_clones=2, batch_size=64,
                            clone_shares=['auto']),
    'shares 3:1': dict(num_clones=2, batch_size=64, clone_shares=['3', '1']),
    'two stages': dict(num_clones=1, batch_size=128, num_stages=2),
    'Dense kernels as blocks on (1, 2)': dict(
        num_clones=2, batch_size=64, mesh_shape=['1', '2'],
        mesh_axes=['batch', 'model'], layout_map='{module}:split'),
}


@pytest.mark.slow
@pytest.mark.parametrize('name', LAYOUTS)
def test_the_readme_command_logs_the_golden_losses(name, run_train,
                                                   tmp_path, capsys):
  module = tmp_path / 'golden_layouts.py'
  module.write_text(SPLIT)
  values = {k: v.format(module=module) if isinstance(v, str) else v
            for k, v in LAYOUTS[name].items()}
  run = str(tmp_path / 'run')
  run_train(model_dir=run, train_steps=STEPS, **values)
  with pytest.raises(SystemExit) as done:
    compare.main([run, f'--golden={GOLDEN}',
                  f'--first_steps={FIRST_STEPS.get(name, STEPS)}'])
  out = capsys.readouterr().out
  assert done.value.code == 0, out
  assert out.splitlines()[-1] == (
      f'agree: {FIRST_STEPS.get(name, STEPS)} golden losses, to rtol 1e-05, '
      'atol 1e-06')


def test_a_run_against_a_golden_file_that_differs_fails(tmp_path, capsys):
  """A golden file whose loss differs from the run's: exit 1, the step
  named; a run that logged nothing: every golden step missing."""
  golden = tmp_path / 'golden.json'
  golden.write_text('{"losses": {"1": 2.5}}')
  with pytest.raises(SystemExit) as done:
    compare.main([str(tmp_path), f'--golden={golden}'])
  out = capsys.readouterr().out.splitlines()
  assert done.value.code == 1
  assert out[0] == f'step 1: loss None in {tmp_path}, 2.5 golden'
  with pytest.raises(SystemExit) as done:
    compare.main([str(tmp_path), str(tmp_path), f'--golden={golden}'])
  assert done.value.code == 2
  assert 'give two runs, or one run with --golden' in capsys.readouterr().err
