"""Benchmarks: what each design costs, measured side by side.

  python -m tfmulti.bench           the designs' steps (`designs`)
  python -m tfmulti.bench.e2e       whole training runs, to an accuracy
  python -m tfmulti.bench.pipeline  the model-parallel experiment
  python -m tfmulti.bench.balance   automatic shares on an unequal pair
"""
