"""What a run tested: the checkout's commit, marked when the working tree differs from it.

A matrix or benchmark run tests the files in the working tree. Where they differ from ``HEAD``
(edits, untracked files that git does not ignore, or a tree copied onto a machine over a stale
``.git``), ``HEAD``'s hash alone would name code that did not run: the label then carries the
git tree hash of the tree as it ran, built in a scratch index (the real index is untouched).
``git log --all --format='%h %T' | grep <hash>`` finds the commit that holds that tree.
"""

from __future__ import annotations

import os
import subprocess
import tempfile


def describe(root: str | os.PathLike[str] = ".", *, short: int = 12, dirty: bool = True) -> str:
    """``HEAD``'s hash (``short`` hex digits), ``<HEAD>+tree:<12 hex>`` when the working tree at
    ``root`` differs from ``HEAD`` (unless ``dirty`` is false: ``HEAD`` alone), or ``unknown``
    where git or a repository is missing."""

    def git(*args: str, env: dict[str, str] | None = None) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, env=env, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", f"--short={short}", "HEAD")
        if not dirty or not git("--no-optional-locks", "status", "--porcelain"):
            return head
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
            git("read-tree", "HEAD", env=env)
            git("add", "-A", env=env)
            return f"{head}+tree:{git('write-tree', env=env)[:12]}"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def head(root: str | os.PathLike[str] = ".") -> str | None:
    """``HEAD``'s full hash at ``root`` (what a Job or an image build checks out), or ``None``
    where git or a repository is missing."""
    label = describe(root, short=40, dirty=False)
    return None if label == "unknown" else label
