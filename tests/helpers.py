"""Test-only pieces that are plugged in through config (`reward._target_=tests.helpers.VowelFractionReward`)."""


class VowelFractionReward:
    """Fraction of characters that are vowels: a dense reward that varies across a random model's samples.

    GSM8K correctness is 0 for every sample of a random model, which makes every advantage 0 and every
    gradient 0; this reward gives the end-to-end tests a real learning signal.
    """

    def __call__(self, completion: str, answer: str) -> float:
        return sum(ch in "aeiou" for ch in completion) / max(len(completion), 1)
