#!/usr/bin/env bash
# Generate the matrix pipeline (nox -s pipeline) and upload it. On a pull request, cells are
# selected by the files changed since the merge base with the target branch; on other builds
# every cell runs.
set -euo pipefail
cd "$(dirname "$0")/.."

# The agent's nox, else one in a venv of this checkout's own (a distribution's system Python
# refuses `pip install` outside a venv, PEP 668).
if ! command -v nox >/dev/null; then
  python3 -m venv .nox-bootstrap
  .nox-bootstrap/bin/python -m pip install -q --disable-pip-version-check "nox>=2025.2.9"
  PATH="$PWD/.nox-bootstrap/bin:$PATH"
fi

args=(--lanes "${KUBEMATRIX_LANES:-queues}" --output results/generated-pipeline.yml)
base="${BUILDKITE_PULL_REQUEST_BASE_BRANCH:-}"
if [[ "${BUILDKITE_PULL_REQUEST:-false}" != "false" && -n "$base" ]]; then
  git fetch --quiet origin "$base"
  args+=(--changed-since "origin/$base")
fi

mkdir -p results
nox -s pipeline -- "${args[@]}"
buildkite-agent pipeline upload results/generated-pipeline.yml
