"""`kubematrix.checkout.describe` on real git repositories: the label a run's report carries
names the tree that ran, not a commit it differs from."""

from __future__ import annotations

import subprocess

import pytest

from kubematrix import checkout
from kubematrix.__main__ import main


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    _git(r, "config", "user.email", "t@example.com")
    _git(r, "config", "user.name", "t")
    (r / ".gitignore").write_text("ignored/\n")
    (r / "a.py").write_text("x = 1\n")
    _git(r, "add", "-A")
    _git(r, "commit", "-qm", "one")
    return r


def test_a_clean_checkout_is_its_commit(repo):
    assert checkout.describe(repo) == _git(repo, "rev-parse", "--short=12", "HEAD")
    assert checkout.describe(repo, short=7) == _git(repo, "rev-parse", "--short=7", "HEAD")
    (repo / "ignored").mkdir()
    (repo / "ignored" / "cache.bin").write_text("not source")  # ignored files change nothing
    assert checkout.describe(repo) == _git(repo, "rev-parse", "--short=12", "HEAD")


@pytest.mark.parametrize("change", ["edit", "untracked", "delete"])
def test_a_changed_tree_names_the_tree_that_ran(repo, change):
    head = _git(repo, "rev-parse", "--short=12", "HEAD")
    index_before = (repo / ".git" / "index").read_bytes()
    if change == "edit":
        (repo / "a.py").write_text("x = 2\n")
    elif change == "untracked":
        (repo / "b.py").write_text("y = 1\n")
    else:
        (repo / "a.py").unlink()
    label = checkout.describe(repo)
    assert label.startswith(f"{head}+tree:") and len(label) == len(head) + 6 + 12
    assert checkout.describe(repo, dirty=False) == head
    assert (repo / ".git" / "index").read_bytes() == index_before  # the real index untouched
    # committing exactly that tree gives a commit whose tree hash the label names
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "two", "--allow-empty")
    assert _git(repo, "rev-parse", "HEAD^{tree}").startswith(label.split("+tree:")[1])


def test_no_repository_is_unknown(tmp_path):
    assert checkout.describe(tmp_path) == "unknown"


def test_the_matrix_summary_names_the_tree_it_tested(repo, tmp_path, monkeypatch, capsys):
    """The local runner tests the working tree: with an edit, the summary's commit carries the
    tree's hash (it named ``HEAD`` alone, code that did not run)."""
    (repo / "tests").mkdir()
    (repo / "tests" / "conftest.py").write_text("")
    (repo / "pyproject.toml").write_text("")  # a project root of its own (local.PROJECT_MARKER)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "a project")
    (repo / "a.py").write_text("x = 3\n")
    monkeypatch.chdir(repo)
    out = tmp_path / "r"
    main(["matrix", "--cell", "mla-cuda-sm_90", "--results", str(out)])  # not run: no GPU here
    capsys.readouterr()
    summary = (out / "report.md").read_text()
    assert f"commit `{checkout.describe(repo)}`" in summary and "+tree:" in summary


def test_under_the_k8s_runner_a_changed_tree_is_named_beside_the_commit_the_jobs_run(
    repo, monkeypatch
):
    from kubematrix.__main__ import _tested

    monkeypatch.chdir(repo)
    head = checkout.describe(repo)
    assert _tested("k8s") == _tested("local") == f"commit `{head}`"
    (repo / "a.py").write_text("x = 4\n")
    tree = checkout.describe(repo)
    assert _tested("local") == f"commit `{tree}`"
    assert _tested("k8s") == f"commit `{head}` (GPU Jobs), this machine's cells `{tree}`"
    assert checkout.head(repo) == _git(repo, "rev-parse", "HEAD")


def test_jobs_outside_a_checkout_name_the_missing_commit(repo, tmp_path, monkeypatch, capsys):
    """Outside a checkout the Jobs ran commit "unknown" (an image that does not exist, a Job name
    every such run shared): `python -m kubematrix.k8s` now stops with a usage error before any
    cluster is asked; `--commit` and a checkout both give the commit."""
    pytest.importorskip("kubernetes")
    from kubematrix import k8s

    outside = tmp_path / "outside"
    outside.mkdir()
    with pytest.raises(ValueError, match=r"^no commit for the Jobs: .*outside is not a git"):
        k8s.git_commit(outside)
    assert k8s.git_commit(repo) == _git(repo, "rev-parse", "HEAD")
    monkeypatch.chdir(outside)
    assert k8s.main(["--vendor", "cuda", "--suite", "mla"]) == 2
    err = capsys.readouterr().err
    assert "no commit for the Jobs" in err and "nothing was created" in err
