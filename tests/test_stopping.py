"""first_stop answers what generate()'s criteria, asked after every new token, would: checked against that loop."""
import random

import pytest
import torch
from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria,
                                                       StoppingCriteria, StoppingCriteriaList)

from eagle_mm.decode.stopping import Stops, first_stop

pytestmark = pytest.mark.compat  # HF's criteria classes are read by type: check them on the oldest release too


class SumIs(StoppingCriteria):
    """A user criterion first_stop cannot read: the last two tokens add up to ``total``. Counts its calls."""

    def __init__(self, total: int):
        self.total, self.calls = total, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if input_ids.shape[1] < 2:
            return torch.zeros(1, dtype=torch.bool)
        return input_ids[:, -2:].sum(-1) == self.total


def per_token(criteria, seq, start):
    """generate()'s way: ask after each new token."""
    for i in range(seq.shape[1] - start):
        if bool(criteria(seq[:, : start + i + 1], None).any()):
            return i
    return None


def test_matches_asking_after_every_token():
    rng = random.Random(0)
    for trial in range(400):
        start = rng.randint(1, 12)
        seq = torch.tensor([[rng.randint(0, 9) for _ in range(start + rng.randint(1, 8))]])
        crit = []
        if rng.random() < 0.6:
            crit.append(MaxLengthCriteria(max_length=rng.randint(1, 22)))
        if rng.random() < 0.6:
            crit.append(EosTokenCriteria(eos_token_id=rng.sample(range(10), rng.randint(1, 2))))
        if rng.random() < 0.4:
            crit.append(SumIs(rng.randint(0, 18)))
        if rng.random() < 0.2:
            crit.append(MaxTimeCriteria(max_time=0.0 if rng.random() < 0.5 else 1e9))
        criteria = StoppingCriteriaList(crit)
        assert first_stop(Stops.of(criteria), seq, start) == per_token(criteria, seq, start), (trial, seq, start, crit)


def test_known_criteria_are_not_called_per_token():
    """Only the criterion it cannot read is asked, and only up to the earliest stop of the others."""
    seq = torch.tensor([[5, 1, 2, 3, 4, 7, 6]])
    user = SumIs(13)  # 7 + 6 fires at the last token, i = 3
    criteria = StoppingCriteriaList([EosTokenCriteria(eos_token_id=4), user])  # EOS at i = 1
    assert first_stop(Stops.of(criteria), seq, 3) == 1
    assert user.calls == 1  # prefix i = 0 only: the EOS at i = 1 stops first
    assert first_stop(Stops.of(StoppingCriteriaList([user])), seq, 3) == 3


@pytest.mark.parametrize("criteria", (None, StoppingCriteriaList()))
def test_no_criteria_never_stop(criteria):
    assert first_stop(Stops.of(criteria), torch.tensor([[1, 2, 3]]), 1) is None
