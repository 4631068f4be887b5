"""kubematrix: the CI matrix (cells, local runner, Kubernetes Jobs, Buildkite pipeline)."""

#: What to install for the Kubernetes runner, whose client is an optional dependency.
CI_EXTRA_HINT = "install it with: pip install 'portattn[ci]'"
