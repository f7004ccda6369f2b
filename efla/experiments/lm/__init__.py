"""Language models: training (train.py) and evaluation (evaluate.py)."""
