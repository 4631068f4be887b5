"""The target table's lookups and the policy override refuse what is not a target."""

from __future__ import annotations

import re

import pytest
import torch

from portattn.platform import (
    TARGETS,
    Target,
    current_target,
    get_target,
    set_target_override,
    target_for_tensor,
    target_override,
)

pytestmark = pytest.mark.policy


@pytest.mark.parametrize(
    "fields, message",
    [
        (("cuda", "sm_90", 0, 1000, 1), "warp_size must be 32 or 64; got 0"),
        (("cuda", "sm_90", True, 1000, 1), "warp_size must be 32 or 64; got True"),
        (("hip", "bogus", 64, -1, -5), "arch must be 'gfx<...>' for vendor 'hip'; got 'bogus'; "
         "max_shared_mem must be an int >= 1; got -1; num_sms must be an int >= 1; got -5"),
        (("cuda", "sm_9x", 32, 1000, 1), "arch must be 'sm_<capability>' for vendor 'cuda'"),
        (("rocm", "gfx942", 64, 1000, 1), "vendor must be 'cuda' or 'hip'; got 'rocm'"),
        (("cuda", "sm_90", 32, 1000, 1, 0), "mma_min_rows must be an int >= 1; got 0"),
        (("hip", "gfx942", 64, 1000, 1, 16, 1.5), "max_num_stages must be an int >= 1; got 1.5"),
    ],
)  # fmt: skip
def test_a_target_with_a_field_no_policy_can_use_is_refused(fields, message):
    """The policies divide and budget by these fields: a bad one fails at construction."""
    with pytest.raises(ValueError, match=re.escape(f"Target: {message}")):
        Target(*fields)


def test_every_table_target_is_valid():
    assert all(Target(*vars(t).values()) == t for t in TARGETS.values())


@pytest.mark.parametrize("arch", (["sm_90"], 90, None, b"sm_90"))
def test_get_target_names_a_non_string_arch(arch):
    with pytest.raises(
        TypeError,
        match=re.escape(f"get_target: arch must be a str, one of {sorted(TARGETS)}; got {arch!r}"),
    ):
        get_target(arch)


def test_get_target_names_an_unknown_arch():
    with pytest.raises(ValueError, match=re.escape("get_target: arch must be one of")):
        get_target("sm_91")


@pytest.mark.parametrize("target", (0, 1.5, ["sm_90"], object()))
def test_the_override_takes_a_target_an_arch_name_or_none(target):
    set_target_override("gfx942")
    try:
        with pytest.raises(
            TypeError,
            match=re.escape(
                "set_target_override: target must be a portattn Target, an arch name (one of "
                f"{sorted(TARGETS)}) or None; got {target!r}"
            ),
        ):
            set_target_override(target)
        assert target_override() == get_target("gfx942")  # a refused call changes nothing
        set_target_override(get_target("sm_80"))
        assert target_override() == get_target("sm_80")
    finally:
        set_target_override(None)
    assert target_override() is None or isinstance(target_override(), str)


def test_the_override_names_an_unknown_arch():
    with pytest.raises(ValueError, match=re.escape("set_target_override: target must be one of")):
        set_target_override("cuda:0")
    assert target_override() is None or isinstance(target_override(), str)


@pytest.mark.parametrize("value", ("sm90", "cuda", " sm_90"))
def test_a_bad_portattn_target_is_named_as_the_variable(value, monkeypatch):
    """Not as get_target's argument: the user set an environment variable, not an argument."""
    monkeypatch.setenv("PORTATTN_TARGET", value)
    message = re.escape(
        f"PORTATTN_TARGET (when set) must be one of {sorted(TARGETS)}; got {value!r}"
    )
    with pytest.raises(ValueError, match=message):
        target_for_tensor(torch.empty(1))
    with pytest.raises(ValueError, match=message):
        current_target()


def test_an_empty_portattn_target_is_unset(monkeypatch):
    monkeypatch.setenv("PORTATTN_TARGET", "")
    assert target_for_tensor(torch.empty(1)) == get_target("sm_90")
    monkeypatch.setenv("PORTATTN_TARGET", "gfx942")
    assert target_for_tensor(torch.empty(1)) == get_target("gfx942")
