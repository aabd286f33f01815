"""The README's ResNet-20 commands against the losses they logged once
(`tests/golden/readme_resnet20_digits.json` and
`readme_resnet20_sync_digits.json`, written by `python -m tfmulti.compare
RUN --write_golden=...` from `python train.py --num_clones=2 --clone_on_cpu
--model=resnet20 --batch_norm_policy=full_batch` (or `--sync_batch_norm`)
`--train_steps=10 --log_every_steps=1 --noexport`).

Each clone normalises its own rows without `--sync_batch_norm`: the
layouts that keep the clones' rows train the same job (the policies
differ only in the moving statistics, which no training loss reads), so
log the same losses. With it, every layout normalises the global batch:
1 and 4 clones log the golden first loss; after Adam's first step the
losses part as one device's do from itself under another kernel
library (docs/design.md, "Which number to compare")."""

import os

import pytest

from tfmulti import compare

GOLDEN = os.path.join(os.path.dirname(__file__), 'golden')
STEPS = 10
README = dict(num_clones=2, batch_size=64, model='resnet20')

LAYOUTS = {  # name: (golden file, flags, the golden steps compared)
    "the README's full_batch command": (
        'readme_resnet20_digits.json',
        dict(README, batch_norm_policy='full_batch'), STEPS),
    "the README's mean command": (
        'readme_resnet20_digits.json',
        dict(README, batch_norm_policy='mean'), STEPS),
    'its clones spread their variables': (
        'readme_resnet20_digits.json',
        dict(README, batch_norm_policy='full_batch',
             variables_device='spread'), STEPS),
    "the README's sync_batch_norm command": (
        'readme_resnet20_sync_digits.json',
        dict(README, sync_batch_norm=True), STEPS),
    'synchronized, one clone': (
        'readme_resnet20_sync_digits.json',
        dict(README, num_clones=1, batch_size=128), 1),
    'synchronized, four clones': (
        'readme_resnet20_sync_digits.json',
        dict(README, num_clones=4, batch_size=32, sync_batch_norm=True), 1),
}


@pytest.mark.slow
@pytest.mark.parametrize('name', LAYOUTS)
def test_the_readme_resnet20_commands_log_the_golden_losses(
    name, run_train, tmp_path, capsys):
  golden, values, steps = LAYOUTS[name]
  run = str(tmp_path / 'run')
  run_train(model_dir=run, train_steps=steps, **values)
  with pytest.raises(SystemExit) as done:
    compare.main([run, f'--golden={os.path.join(GOLDEN, golden)}',
                  f'--first_steps={steps}'])
  out = capsys.readouterr().out
  assert done.value.code == 0, out
  assert out.splitlines()[-1] == (
      f'agree: {steps} golden losses, to rtol 1e-05, atol 1e-06')


def test_first_steps_needs_a_golden_file_and_a_count(tmp_path, capsys):
  for argv in ([str(tmp_path), str(tmp_path), '--first_steps=1'],
               [str(tmp_path), '--golden=g.json', '--first_steps=0']):
    with pytest.raises(SystemExit) as done:
      compare.main(argv)
    assert done.value.code == 2
    assert 'give a count of 1 or more, with --golden' in (
        capsys.readouterr().err)
