"""portattn's benchmark suite: ``python -m bench.run`` (bench/README.md)."""
