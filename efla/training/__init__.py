"""Training language models: ``efla train``'s run settings (config.py), the training loop (trainer.py)
with its data (data.py), learning-rate schedule (schedule.py), optimiser step (step.py), progress and
logs (session.py), resume and output-directory claims (start.py, run_dir.py), checkpoints
(checkpoint.py) and the torchrun process group (process_group.py)."""
