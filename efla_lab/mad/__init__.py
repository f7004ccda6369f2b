"""The MAD synthetic benchmark: the model and one training run (model.py), the grid of runs (run.py),
the scores and output files (report.py)."""
