"""`python -m tfmulti.bench`: the designs' step costs (`designs`)."""

from tfmulti.bench import designs

if __name__ == '__main__':
  designs.main()
