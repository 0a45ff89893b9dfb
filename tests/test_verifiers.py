"""Built-in verifiers, the overlong penalty and dynamic sampling's group selection, by hand."""

import pytest

from llamarl.config import RewardConfig
from llamarl.rewards.dynamic_sampling import collect_groups, is_informative
from llamarl.rewards.registry import resolve_builtin
from llamarl.rewards.scorer import ScoredGroup
from llamarl.rewards.shaping import overlong_penalty
from llamarl.rewards.verifiers import (
    FormatReward,
    boxed,
    final_number,
    gsm8k,
    gsm8k_number,
    last_boxed,
    numeric,
    parse_number,
)

SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72"


def test_parse_number_forms():
    assert parse_number("1,000") == 1000.0
    assert parse_number("$18") == 18.0
    assert parse_number(" 72. ") == 72.0
    assert parse_number("-3.5") == -3.5
    assert parse_number(".5") == 0.5
    for bad in ("", "abc", "inf", "nan", "1e5", "1_000", "50%", "--"):
        assert parse_number(bad) is None, bad


def test_gsm8k_number_takes_the_last_marker():
    assert gsm8k_number("#### 5\nno wait\n#### 1,234") == 1234.0
    assert gsm8k_number("so the answer is\n####   -7.") == -7.0
    assert gsm8k_number("####$18") == 18.0
    assert gsm8k_number("the answer is 72") is None  # no marker
    assert gsm8k_number("#### seventy-two") is None  # marker, no number after it


def test_gsm8k_against_solution_and_bare_answers():
    assert gsm8k("reasoning...\n#### 72", SOLUTION, "") == 1.0
    assert gsm8k("#### 72.0", "72", "") == 1.0
    assert gsm8k("#### 72.", "#### 72", "") == 1.0
    assert gsm8k("#### $1,000", "1000", "") == 1.0
    assert gsm8k("#### 71", SOLUTION, "") == 0.0
    assert gsm8k("72", SOLUTION, "") == 0.0  # the number must follow ####
    assert gsm8k("#### 72\nactually\n#### 73", "72", "") == 0.0  # the last marker counts
    with pytest.raises(ValueError, match="has no number"):
        gsm8k("#### 1", "no number here", "")


def test_last_boxed_with_nested_braces():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"x = \boxed{{a}+{b}} done") == "{a}+{b}"
    assert last_boxed(r"\boxed{unclosed {x}") is None
    assert last_boxed("no box") is None


def test_boxed_numeric_and_string_comparison():
    assert boxed(r"so \boxed{72}", "72", "") == 1.0
    assert boxed(r"\boxed{72.0}", r"the answer is \boxed{72}", "") == 1.0
    assert boxed(r"\boxed{1,000}", SOLUTION.replace("72", "1000"), "") == 1.0
    assert boxed(r"\boxed{\dfrac{1}{2}}", "0.5", "") == 1.0  # fraction vs decimal
    assert boxed(r"\boxed{3/4}", r"\frac{3}{4}", "") == 1.0
    assert boxed(r"\boxed{\$18}", "18", "") == 1.0
    assert boxed(r"\boxed{ x + 1 }", "x+1", "") == 1.0  # normalised string match
    assert boxed(r"\boxed{\left( 1,2 \right)}", "(1,2)", "") == 1.0
    assert boxed(r"\boxed{x+2}", "x+1", "") == 0.0
    assert boxed(r"\boxed{71}", "72", "") == 0.0
    assert boxed("72", "72", "") == 0.0  # no box, no reward


def test_format_reward_default_pattern_and_a_custom_one():
    fmt = resolve_builtin("format", RewardConfig().format_pattern)
    assert fmt("step one\nstep two\n#### 72", "", "") == 1.0
    assert fmt("#### -1,000.5\n", "", "") == 1.0
    assert fmt("step\n#### 72 apples", "", "") == 0.0  # not a bare number
    assert fmt("the answer #### 72", "", "") == 0.0  # not on its own line
    assert fmt("#### 72\nmore text", "", "") == 0.0  # not the final line
    think = FormatReward(r"^<think>.*</think>")
    assert think("<think>x</think> 3", "", "") == 1.0 and think("3", "", "") == 0.0


def test_overlong_penalty_by_hand():
    # L_max = 20, L_cache = 4, factor 1: no penalty up to 16, then -1/4 per token, -1 beyond 20
    assert [overlong_penalty(n, 20, 4, 1.0) for n in (10, 16, 17, 18, 20, 21)] == \
        [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(19, 20, 4, 0.5) == pytest.approx(-0.375)  # (16 - 19) / 4 * 0.5
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0  # buffer 0: off


def test_is_informative():
    assert is_informative([0.0, 1.0, 1.0])
    assert not is_informative([1.0, 1.0, 1.0])
    assert not is_informative([0.5, 0.5 + 1e-9])  # float noise is not signal


def _fake_sampler(rewards_by_prompt):
    """sample() over prompts named by ints, rewards from a table; records the calls."""
    calls = []

    def sample(prompts, round_, first):
        calls.append((list(prompts), round_, first))
        return [ScoredGroup(p, [None] * 2, rewards_by_prompt[p], {}, first + i)
                for i, p in enumerate(prompts)]
    return sample, calls


def _stream():
    nxt = iter(range(1000))
    return lambda n: [next(nxt) for _ in range(n)]


def test_dynamic_sampling_refills_until_the_batch_is_informative():
    # prompts 0..9: odd ones informative, even ones all-equal
    table = {p: ([0.0, 1.0] if p % 2 else [1.0, 1.0]) for p in range(10)}
    sample, calls = _fake_sampler(table)
    groups, stats = collect_groups(_stream(), sample, want=4, dynamic=True, max_rounds=5)
    # round 0 draws 0-3 (keeps 1, 3), round 1 draws 4, 5 (keeps 5), round 2 draws 6 (drops),
    # round 3 draws 7 (keeps): 4 kept after 4 rounds
    assert [c[0] for c in calls] == [[0, 1, 2, 3], [4, 5], [6], [7]]
    assert [c[2] for c in calls] == [0, 4, 6, 7]  # first index: unique group positions
    assert [g.prompt for g in groups] == [1, 3, 5, 7]
    assert [g.index for g in groups] == [1, 3, 5, 7]
    assert stats == {"ds_rounds": 4, "ds_dropped_groups": 4, "ds_filled_groups": 0}


def test_dynamic_sampling_fills_after_max_rounds():
    table = {p: ([0.0, 1.0] if p == 1 else [0.0, 0.0]) for p in range(10)}
    sample, calls = _fake_sampler(table)
    groups, stats = collect_groups(_stream(), sample, want=3, dynamic=True, max_rounds=2)
    # round 0: 0, 1, 2 (keeps 1); round 1: 3, 4 (none); fill 2 slots with the latest dropped
    assert [g.prompt for g in groups] == [1, 3, 4]
    assert stats == {"ds_rounds": 2, "ds_dropped_groups": 2, "ds_filled_groups": 2}


def test_without_dynamic_sampling_everything_is_kept_in_one_round():
    sample, calls = _fake_sampler({p: [1.0, 1.0] for p in range(10)})
    groups, stats = collect_groups(_stream(), sample, want=3, dynamic=False, max_rounds=4)
    assert [g.prompt for g in groups] == [0, 1, 2] and len(calls) == 1
    assert stats == {"ds_rounds": 1, "ds_dropped_groups": 0, "ds_filled_groups": 0}


def test_numeric_reads_the_last_number_or_the_tagged_answer():
    for text, value in (("85", 85.0), ("The answer is 85.", 85.0), ("47 + 38 = 85", 85.0),
                        ("1,000", 1000.0), ("It is -3", -3.0), ("x=-3", -3.0), ("12.0", 12.0),
                        ("$18", 18.0), ("5-3", 3.0), ("1, 2", 2.0),
                        ("<answer>1,000</answer> and then 7", 1000.0)):
        assert final_number(text) == value, text
    for text in ("no number", "<answer>eighty</answer> 85", ""):
        assert final_number(text) is None, text


def test_numeric_reward():
    assert numeric("47 + 38 = 85", "85", "What is 47 + 38?") == 1.0
    assert numeric("85.0", "85", "") == 1.0
    assert numeric("The sum is 1,000.", "1000", "") == 1.0
    assert numeric("-3", "-3", "") == 1.0 and numeric("3", "-3", "") == 0.0
    assert numeric("85 or 86", "85", "") == 0.0  # the last number counts
    assert numeric("I think 84", SOLUTION.replace("72", "84"), "") == 1.0  # GSM8K reference
    assert numeric("nothing", "85", "") == 0.0
    assert resolve_builtin("numeric", "") is numeric
