"""Language models: the run settings (config.py), training (train.py) with its learning-rate schedule
(schedule.py), checkpoints (checkpoint.py) and process group (distributed.py), evaluation
(evaluate.py) and the report of several runs (report.py)."""
