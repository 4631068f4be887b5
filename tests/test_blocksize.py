"""Block-size negotiation (docs/design.md lesson 5) and each op's declared block sizes."""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from portattn.blocksize import MultipleOf, Participant, select_common_block_size
from portattn.ops_registry import participant, supported_block_sizes

pytestmark = pytest.mark.specdec


# -- rule validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", (0, -16, 1.5, "16", None, True))
def test_multiple_of_refuses_anything_but_a_positive_int(n):
    """A value problem (an int below 1) is a ValueError, a type problem a TypeError."""
    kind = ValueError if type(n) is int else TypeError
    with pytest.raises(kind, match=re.escape(f"MultipleOf: n must be an int >= 1; got {n!r}")):
        MultipleOf(n)


def test_multiple_of_holds_exactly_the_positive_multiples():
    assert 544 in MultipleOf(16) and 2048 in MultipleOf(16)
    assert 8 not in MultipleOf(16) and 0 not in MultipleOf(16) and -16 not in MultipleOf(16)
    assert str(MultipleOf(16)) == "MultipleOf(16)"


def test_a_participant_without_a_rule_is_refused():
    with pytest.raises(ValueError, match="Participant 'draft': supported must name at least one"):
        Participant("draft", ())


@pytest.mark.parametrize("supported", (16, "16", MultipleOf(16), None))
def test_a_participant_takes_a_list_or_tuple_of_rules(supported):
    """One rule where a sequence of them belongs: an int was iterated (TypeError naming no
    argument), a string read as the rules "1" and "6"."""
    msg = "Participant 'draft': supported must be a list or tuple of rules"
    with pytest.raises(TypeError, match=re.escape(msg)):
        Participant("draft", supported)


@pytest.mark.parametrize("rule", (0, -1, "16", 16.0, True))
def test_a_participant_rule_must_be_a_positive_int_or_multiple_of(rule):
    msg = f"Participant 'mla': each rule must be an int >= 1 or MultipleOf; got {rule!r}"
    kind = ValueError if type(rule) is int else TypeError
    with pytest.raises(kind, match=re.escape(msg)):
        Participant("mla", (MultipleOf(1), rule))


def test_a_participant_keeps_its_rules_as_checked():
    """The caller's list changing after the checks (a string appended) crashed the selection
    with a TypeError from comparing it."""
    rules = [16]
    p = Participant("draft", rules)
    rules.append("32")
    assert p.supported == (16,)
    assert select_common_block_size(p) == 16


# -- select_common_block_size ------------------------------------------------------------------


def test_a_hybrid_minimum_is_met_by_the_smallest_common_multiple_above_it():
    """A Mamba page needs >= 544; MultipleOf(16) and MultipleOf(1) meet at 544 itself."""
    draft = Participant("draft", (MultipleOf(16),))
    target = Participant("target", (MultipleOf(1),))
    assert select_common_block_size(draft, target, min_block_size=544) == 544


def test_exact_sizes_meet_at_the_smallest_shared_one():
    a = Participant("a", (16, 32, 64))
    b = Participant("b", (64, 32, 128))
    assert select_common_block_size(a, b) == 32


def test_exact_sizes_and_multiples_meet_at_an_exact_size_that_is_a_multiple():
    exact = Participant("flashmla", (64,))
    multiple = Participant("triton", (MultipleOf(16),))
    assert select_common_block_size(exact, multiple) == 64
    assert select_common_block_size(Participant("x", (48, 96)), multiple, min_block_size=50) == 96


def test_a_preferred_size_wins_when_every_rule_and_the_minimum_accept_it():
    a = Participant("a", (MultipleOf(16),))
    b = Participant("b", (MultipleOf(1),))
    assert select_common_block_size(a, b, preferred=2048) == 2048
    assert select_common_block_size(a, b, preferred=100) == 16  # 100 % 16 != 0: smallest
    assert select_common_block_size(a, b, preferred=32, min_block_size=544) == 544  # below min


def test_failure_lists_every_constraint():
    a = Participant("mla_target", (64,))
    b = Participant("draft_attention", (MultipleOf(16), 8))
    c = Participant("state", (MultipleOf(5),))
    msg = (
        "select_common_block_size: no block size >= 1 (and <= 65536) is supported by every "
        "participant; constraints: mla_target: 64; draft_attention: MultipleOf(16) | 8; "
        "state: MultipleOf(5)"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        select_common_block_size(a, b, c)


def test_search_bound_and_argument_errors():
    with pytest.raises(ValueError, match=re.escape("no block size >= 17 (and <= 100)")):
        select_common_block_size(Participant("a", (16,)), min_block_size=17, max_block_size=100)
    with pytest.raises(ValueError, match="participants must name at least one kernel"):
        select_common_block_size()
    with pytest.raises(ValueError, match="min_block_size must be an int >= 1; got 0"):
        select_common_block_size(Participant("a", (16,)), min_block_size=0)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(min_block_size=1.5), TypeError, "min_block_size must be an int >= 1; got 1.5"),
        (dict(min_block_size=True), TypeError, "min_block_size must be an int >= 1; got True"),
        (dict(min_block_size="4"), TypeError, "min_block_size must be an int >= 1; got '4'"),
        (dict(preferred="16"), TypeError, "preferred must be an int >= 1 or None; got '16'"),
        (dict(max_block_size=None), TypeError, "max_block_size must be an int >= 1; got None"),
        (dict(preferred=0), ValueError, "preferred must be an int >= 1 or None; got 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    """A wrong type is a TypeError (a string or float size was a ValueError), an int out of
    range a ValueError, as the ops raise."""
    with pytest.raises(error, match=re.escape(f"select_common_block_size: {message}")) as info:
        select_common_block_size(Participant("a", (16,)), **kwargs)
    assert type(info.value) is error


def test_every_bad_argument_in_one_error():
    with pytest.raises(TypeError) as info:
        select_common_block_size("draft", Participant("a", (16,)), min_block_size=2.0, preferred=0)
    msg = str(info.value)
    for part in ("participants[0] must be a Participant; got str", "min_block_size must be an int",
                 "preferred must be an int >= 1 or None; got 0"):  # fmt: skip
        assert part in msg, msg


# -- what the ops declare ----------------------------------------------------------------------

COPY_OPS = ("write_kv_cache", "gather_kv_cache", "expand_page_indices")


@pytest.mark.parametrize("op", COPY_OPS)
def test_copy_ops_support_every_block_size(op):
    assert supported_block_sizes(op) == (MultipleOf(1),)


@pytest.mark.parametrize("dtype, x", [(torch.float16, 8), (torch.bfloat16, 8), (torch.float32, 4)])
def test_shuffle_needs_multiples_of_x(dtype, x):
    assert supported_block_sizes("write_kv_cache", layout="SHUFFLE", dtype=dtype) == (
        MultipleOf(x),
    )


def test_speculative_group_with_shuffle_write_and_hybrid_minimum():
    """A SHUFFLE fp16 writer, an NHD gather and page expansion: 544 = 68 x 8 serves all."""
    parts = (
        participant("write_kv_cache", layout="SHUFFLE"),
        participant("gather_kv_cache", "draft gather"),
        participant("expand_page_indices"),
    )
    assert parts[1].name == "draft gather"
    assert select_common_block_size(*parts, min_block_size=540) == 544


def test_the_registry_refuses_unknown_ops_and_layouts_and_keeps_shuffle_to_multiples_of_x(
    monkeypatch,
):
    with pytest.raises(ValueError, match="supported_block_sizes: op must be one of .*; got 'x'"):
        supported_block_sizes("x")
    with pytest.raises(ValueError, match="supported_block_sizes: layout must be one of"):
        supported_block_sizes("write_kv_cache", layout="HND")
    # A module that reads NHD only, with exact sizes, some not multiples of x.
    mod = types.ModuleType("portattn_test_nhd_only")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(sys.modules["portattn.ops_registry"].OP_MODULES, "nhd_only", mod.__name__)
    with pytest.raises(ValueError, match="portattn_test_nhd_only must declare SUPPORTED_BLOCK"):
        supported_block_sizes("nhd_only")
    mod.SUPPORTED_BLOCK_SIZES = (1, 64, MultipleOf(12))  # type: ignore[attr-defined]
    mod.SUPPORTED_LAYOUTS = ("NHD",)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"layout for nhd_only must be one of \('NHD',\)"):
        supported_block_sizes("nhd_only", layout="SHUFFLE")
    mod.SUPPORTED_LAYOUTS = ("NHD", "SHUFFLE")  # type: ignore[attr-defined]
    rules = supported_block_sizes("nhd_only", layout="SHUFFLE", dtype=torch.float16)
    assert rules == (64, MultipleOf(24))
    mod.SUPPORTED_BLOCK_SIZES = (2, 4)  # type: ignore[attr-defined]
    with pytest.raises(
        ValueError, match="nhd_only supports no block size that is a multiple of x=8"
    ):
        supported_block_sizes("nhd_only", layout="SHUFFLE")


def test_every_public_op_declares_its_block_sizes():
    """The draft (paged attention) and target (MLA) of speculative decoding can negotiate."""
    draft, target = participant("paged_attention"), participant("mla_decode")
    assert select_common_block_size(draft, target, min_block_size=544) == 544
    shuffle = supported_block_sizes("paged_attention", layout="SHUFFLE", dtype=torch.float16)
    assert shuffle == (MultipleOf(8),)


# -- the answer is computed, not searched ------------------------------------------------------

rule_sets = st.lists(
    st.one_of(st.integers(1, 96), st.builds(MultipleOf, st.integers(1, 24))), min_size=1, max_size=3
)


@settings(max_examples=300, deadline=None)
@given(st.lists(rule_sets, min_size=1, max_size=4), st.integers(1, 200), st.integers(1, 3000))
def test_the_answer_is_the_smallest_accepted_size_in_range(rules, low, high):
    """Against a scan of every size in ``[low, high]``, the definition itself."""
    parts = [Participant(f"p{i}", r) for i, r in enumerate(rules)]
    want = next((s for s in range(low, high + 1) if all(p.accepts(s) for p in parts)), None)
    if low > high:
        with pytest.raises(ValueError, match="min_block_size must be <= max_block_size"):
            select_common_block_size(*parts, min_block_size=low, max_block_size=high)
    elif want is None:
        with pytest.raises(ValueError, match="no block size >= "):
            select_common_block_size(*parts, min_block_size=low, max_block_size=high)
    else:
        assert select_common_block_size(*parts, min_block_size=low, max_block_size=high) == want


@settings(max_examples=200, deadline=None)
@given(st.lists(rule_sets, min_size=1, max_size=4), st.integers(1, 3000), st.integers(1, 200),
       st.integers(1, 3000))  # fmt: skip
def test_a_preferred_size_is_taken_only_inside_the_range(rules, preferred, low, high):
    """``preferred`` wins only where every participant takes it and it lies in ``[low, high]``;
    whatever comes back lies there."""
    parts = [Participant(f"p{i}", r) for i, r in enumerate(rules)]
    if low > high:
        return
    try:
        got = select_common_block_size(
            *parts, preferred=preferred, min_block_size=low, max_block_size=high
        )
    except ValueError:
        assert not any(all(p.accepts(s) for p in parts) for s in range(low, high + 1))
        return
    assert low <= got <= high and all(p.accepts(got) for p in parts)
    if low <= preferred <= high and all(p.accepts(preferred) for p in parts):
        assert got == preferred


def test_many_participants_of_coprime_rules_take_no_exponential_search():
    """Participant i takes a multiple of any of the first 26 primes: the answer is 2, which the
    pruned search finds at once (every lcm of two primes is divided by a kept prime)."""
    primes = [p for p in range(2, 102) if all(p % d for d in range(2, p))]
    parts = [Participant(f"p{i}", [MultipleOf(n) for n in primes]) for i in range(26)]
    assert select_common_block_size(*parts) == 2
    assert select_common_block_size(*parts, min_block_size=3) == 3
    # distinct primes per participant: the answer is their product, a search that is refused
    # by name past its bound instead of running for hours
    groups = [[MultipleOf(p) for p in primes[i::8]] for i in range(8)]  # 11664 lcms
    with pytest.raises(ValueError, match=r"the search kept over 4096 candidate lcms"):
        select_common_block_size(
            *(Participant(f"q{i}", g) for i, g in enumerate(groups)), max_block_size=2**62
        )


def test_one_participant_of_many_rules_with_a_common_divisor_is_answered():
    """The candidate bound was checked before the rules a divisor covers were dropped: one
    participant taking multiples of 1..4999 was refused as a search too large."""
    part = Participant("a", tuple(MultipleOf(n) for n in range(1, 5000)))
    assert select_common_block_size(part) == 1
    evens = Participant("b", tuple(MultipleOf(n) for n in range(2, 10000, 2)))
    assert select_common_block_size(part, evens, min_block_size=7) == 8


def test_a_far_answer_and_a_huge_bound_cost_no_scan():
    """Coprime multiples meet only at their product; disjoint exact sizes never meet."""
    a, b = Participant("a", (MultipleOf(1_000_003),)), Participant("b", (MultipleOf(999_983),))
    assert select_common_block_size(a, b, max_block_size=2**62) == 1_000_003 * 999_983
    with pytest.raises(ValueError, match=re.escape("(and <= 4611686018427387904)")):
        select_common_block_size(
            Participant("c", (3,)), Participant("d", (5,)), max_block_size=2**62
        )


@pytest.mark.parametrize("name", (5, "", None, b"draft"))
def test_a_participant_is_named_by_a_non_empty_str(name):
    with pytest.raises(
        TypeError, match=re.escape(f"Participant: name must be a non-empty str; got {name!r}")
    ):
        Participant(name, (16,))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: supported_block_sizes(["paged_attention"]), TypeError,
         "supported_block_sizes: op must be a str; got ['paged_attention']"),
        (lambda: supported_block_sizes("paged_attention", layout=None), TypeError,
         "supported_block_sizes: layout must be a str; got None"),
        (lambda: supported_block_sizes("paged_attention", dtype=None), TypeError,
         "supported_block_sizes: dtype must be one of"),
        (lambda: supported_block_sizes("write_kv_cache", layout="SHUFFLE", dtype=torch.int64),
         TypeError, "supported_block_sizes: dtype must be one of"),
        (lambda: supported_block_sizes("paged_attention", dtype="float16"), TypeError,
         "got 'float16'"),
        (lambda: participant("x"), ValueError, "participant: op must be one of"),
        (lambda: participant("paged_attention", layout="nhd"), ValueError,
         "participant: layout must be one of"),
        (lambda: participant("paged_attention", dtype=torch.float64), TypeError,
         "participant: dtype must be one of"),
        (lambda: participant("paged_attention", name=7), TypeError,
         "participant: name must be None or a non-empty str; got 7"),
        (lambda: participant("paged_attention", name=""), TypeError,
         "participant: name must be None or a non-empty str; got ''"),
    ],
)  # fmt: skip
def test_the_registry_names_each_bad_argument(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()
