"""Experiments: each a package (model.py, run.py, report.py) whose functions return plain results and
write files; the services they share (provenance, atomic writes, progress bars, tables) are in
harness.py, the argument parsing and printing in efla/commands."""
