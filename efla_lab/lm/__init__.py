"""The paper's language-model claims: a comparison of several evaluated models against the paper's
Table 1 (compare.py) and the report of several training runs (report.py)."""
