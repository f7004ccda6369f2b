"""Experiments: each a function returning plain results (no printing, no argument parsing)."""
