#!/usr/bin/env bash
# Generate the matrix pipeline (nox -s pipeline) and upload it. On a pull request, cells are
# selected by the files changed since the merge base with the target branch; on other builds
# every cell runs.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install -q --disable-pip-version-check "nox>=2025.2.9"

args=(--lanes "${KUBEMATRIX_LANES:-queues}" --output results/generated-pipeline.yml)
base="${BUILDKITE_PULL_REQUEST_BASE_BRANCH:-}"
if [[ "${BUILDKITE_PULL_REQUEST:-false}" != "false" && -n "$base" ]]; then
  git fetch --quiet origin "$base"
  args+=(--changed-since "origin/$base")
fi

mkdir -p results
nox -s pipeline -- "${args[@]}"
buildkite-agent pipeline upload results/generated-pipeline.yml
