"""Pixel-sequence classification under perturbations: the model (model.py), the runs (run.py), the
tables, plots and files (report.py)."""
