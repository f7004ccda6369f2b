"""The paper's lab, beside the library: sMNIST robustness (robustness/), MAD (mad/), the language-model
claims (lm/: the comparison with the paper's Table 1 and the report of several runs), the one-step
picture (onestep.py) and the demo (demo.py), with their commands (commands/: ``efla demo``,
``efla robustness``, ``efla lr-sweep``, ``efla mad``, ``efla compare``, ``efla lm-report``).

Imports run one way: the lab uses ``efla``; nothing in ``efla`` imports the lab. Each experiment
is a package (model.py, run.py, report.py) whose functions return plain results and write files.
Installed with ``pip install "efla[lab]"`` (matplotlib, scikit-learn, rich)."""
