"""Diagnostics that outlive one question (bench/diag/README.md); not part of the suite's run."""
