"""Answer extraction and the reward contract, including junk and failing scorers."""

import math
from decimal import Decimal

import pytest

from harness.experiment import rewards as R


@pytest.mark.parametrize("text, expected", [
    ("so 3 + 4 = 7 #### 7", "7"),
    ("#### 1,234", "1234"),
    ("#### -5", "-5"),
    ("####+12", "12"),
    ("#### $1,000.50", "1000.50"),
    ("first #### 3 then #### 4", "4"),  # the last #### wins
    ("the answer is \\boxed{42}", "42"),
    ("\\boxed{-3.25} done", "-3.25"),
    ("about 10 apples, 12 pears.", "12"),  # no marker: the last number
    ("#### .5", "0.5"),
])
def test_extract_answer(text, expected):
    assert R.extract_answer(text) == Decimal(expected)


@pytest.mark.parametrize("junk", ["", None, 42, [], "no numbers here", "🙂 #### 🙂", "####", "#### ,",
                                  "#### " + "9" * 5000, "\x00\x01", "- + .", "#### 1e999999"])
def test_extract_answer_never_raises_on_junk(junk):
    value = R.extract_answer(junk)
    assert value is None or value.is_finite()


def test_correctness_and_format():
    assert R.correctness_reward("3 + 4 = 7 #### 7", "7") == 1.0
    assert R.correctness_reward("#### 7.0", "7") == 1.0  # 7.0 == 7
    assert R.correctness_reward("#### 8", "7") == 0.0
    assert R.correctness_reward("", "7") == 0.0
    assert R.format_reward("#### 7") == 1.0
    assert R.format_reward("7") == 0.0
    assert R.format_reward("#### ") == 0.0  # a marker with no number is not the format


def test_gsm8k_answer_column():
    assert R.gsm8k_answer("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"


def test_batch_functions_follow_trl_contract():
    completions = [[{"role": "assistant", "content": "#### 7"}], "#### 8", [{"role": "assistant", "content": ""}]]
    seen = {}
    out = R.reward_correct(completions, answer=["7", "7", "7"], prompt_idx=[0, 0, 0],
                           log_metric=lambda k, v: seen.__setitem__(k, v))
    assert out == [1.0, 0.0, 0.0]
    assert seen == {"reward_errors/correctness": 0.0}
    assert R.reward_format(completions) == [1.0, 1.0, 0.0]


def test_failing_scorer_scores_zero_and_is_counted():
    def flaky(text):
        if text == "boom":
            raise RuntimeError("scorer bug")
        if text == "none":
            return None
        if text == "nan":
            return math.nan
        return 1.0

    seen = {}
    out = R.score_each("flaky", flaky, [["ok", "boom", "none", "nan", "ok"]], lambda k, v: seen.__setitem__(k, v))
    assert out == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert seen == {"reward_errors/flaky": 3.0}


def test_wrong_length_names_the_function():
    with pytest.raises(ValueError, match="'my_reward' returned 2 rewards, but 3 were expected"):
        R.check_rewards("my_reward", [1.0, 0.0], 3)
    assert R.check_rewards("f", [1, None], 2)[0] == 1.0 and math.isnan(R.check_rewards("f", [1, None], 2)[1])


def test_noise_reward_is_stable_spread_and_in_range():
    from harness.experiment.rewards import noise_reward, reward_noise

    texts = [f"completion {i}" for i in range(400)]
    a = reward_noise([[{"role": "assistant", "content": t}] for t in texts])
    assert a == reward_noise(texts) == [noise_reward(t) for t in texts]  # conversational or plain: same score
    assert all(0.0 <= v < 1.0 for v in a)
    assert 0.45 < sum(a) / len(a) < 0.55 and len(set(a)) == len(a)  # uniform-looking, no ties
    # known answer: the first 8 bytes of sha256("") as a fraction of 2**64
    assert noise_reward("") == int("e3b0c44298fc1c14", 16) / 2**64


@pytest.mark.parametrize("text,answer,expected", [
    ("7 then 9", "3 + 4 = 7 #### 7", 1.0),       # the first number counts
    ("9 then 7", "3 + 4 = 7 #### 7", 0.0),       # a later correct number does not
    ("#### 7", "#### 7", 1.0),
    ("x -1,234.5 y 7", "#### -1234.5", 1.0),     # signs, commas, decimals as for correctness
    ("no number at all", "#### 7", 0.0),          # stopping before any number is wrong
    ("", "#### 7", 0.0),
])
def test_first_answer_reward(text, answer, expected):
    from harness.experiment.rewards import first_answer_reward, reward_first_answer

    assert first_answer_reward(text, answer) == expected
    assert reward_first_answer([[{"role": "assistant", "content": text}]], [answer]) == [expected]
