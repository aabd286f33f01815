"""Tests for tfmulti.bench.e2e on tiny settings (no timing is asserted)."""

import pytest

from tfmulti.bench import e2e as bench_e2e

PHASES = {'startup', 'first_step', 'train_after_first_step', 'evaluation'}


@pytest.mark.slow
def test_every_variant_runs_the_whole_job_and_is_compared(digits_dir):
  e2e = bench_e2e.E2EConfig(model='lenet', global_batch_size=256, epochs=1,
                            rounds=1, data_dir=digits_dir)
  # One of each kind (the others differ by a flag, and the benchmark's
  # own runs use them all).
  rounds = bench_e2e.run(e2e, variants=('tfmulti_2clones', 'fit_one_device',
                                        'towers_fit_2clones'))
  assert set(rounds) == {'tfmulti_2clones', 'fit_one_device',
                         'towers_fit_2clones'}
  for name, runs in rounds.items():
    (entry,) = runs
    assert PHASES <= set(entry), name
    # The phases are parts of the job: together no longer than it.
    assert sum(entry[p] for p in PHASES) <= entry['wall'] + 1e-6, name
    assert 0 <= entry['eval_accuracy'] <= 1
  medians = bench_e2e.summarize(rounds)
  # Each variant's median wall time over `fit`'s.
  for entry in medians.values():
    assert entry['wall_vs_fit'] == pytest.approx(
        entry['wall'] / medians['fit_one_device']['wall'])
  assert 'tfmulti_2clones' in bench_e2e.format_table(medians)


def test_an_odd_global_batch_is_refused():
  with pytest.raises(SystemExit, match='global_batch_size=129: must split'):
    bench_e2e.main(['--global_batch_size=129'])
