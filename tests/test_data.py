"""The user's data: ``batches`` in the model file, fed to the program one global batch per
step (autoplan.data.BatchFeed): checked against the example inputs, epoch after epoch in an
order fixed by the seed, and skipped forward to where a checkpoint left it."""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from autoplan.data import BatchFeed, find_batches
from autoplan.errors import AutoplanError
from autoplan.load import make_model_spec


def _spec(batch: int = 4):
    return make_model_spec(torch.nn.Linear(3, 2), (torch.zeros(batch, 3), torch.zeros(batch, dtype=torch.long)))


def _loader(shuffle: bool = True) -> DataLoader:
    data = TensorDataset(torch.arange(30, dtype=torch.float32).view(10, 3), torch.arange(10))
    return DataLoader(data, batch_size=4, shuffle=shuffle, drop_last=True)  # 2 batches an epoch


def _labels(feed: BatchFeed, n: int) -> list[list[int]]:
    return [feed.next_batch()[1].tolist() for _ in range(n)]


def test_a_shuffled_loader_gives_the_same_order_in_every_run_and_a_new_one_each_epoch() -> None:
    first = _labels(BatchFeed(_spec(), _loader()), 6)
    torch.manual_seed(123)  # the run's own random state does not move the data's order
    assert _labels(BatchFeed(_spec(), _loader()), 6) == first
    epochs = [sorted(first[0] + first[1]), sorted(first[2] + first[3])]
    assert all(len(set(e)) == 8 for e in epochs)  # no sequence twice within an epoch
    assert first[:2] != first[2:4]  # another order in the next epoch
    assert _labels(BatchFeed(_spec(), _loader(), seed=1), 2) != first[:2]


def test_skipping_to_a_position_continues_where_an_uninterrupted_feed_would() -> None:
    whole = _labels(BatchFeed(_spec(), _loader()), 5)
    resumed = BatchFeed(_spec(), _loader())
    resumed.skip_to(3)
    assert resumed.position == 3 and _labels(resumed, 2) == whole[3:]


def test_keyword_batches_and_batches_built_by_a_function() -> None:
    spec = make_model_spec(torch.nn.Identity(), {"x": torch.zeros(2, 3), "mask": None})
    user = types.SimpleNamespace(batches=lambda: [{"x": torch.ones(2, 3)}])
    feed = BatchFeed(spec, find_batches(user, "model.py"))
    (x,) = feed.next_batch()
    assert torch.equal(x, torch.ones(2, 3))


@pytest.mark.parametrize("batch, needle", [
    ((torch.zeros(3, 3), torch.zeros(3, dtype=torch.long)), r"batch 0: input 0 is float32\[3, 3\], the plan is for "
                                                           r"float32\[4, 3\].*drop_last=True"),
    ((torch.zeros(4, 3), torch.zeros(4)), r"batch 0: input 1 is float32\[4\], the plan is for int64\[4\]"),
    ((torch.zeros(4, 3),), r"batch 0 has 1 input\(s\), the plan is for 2"),
    ("text", r"batch 0 is a str"),
])
def test_a_batch_unlike_the_example_inputs_is_named_in_one_line(batch, needle: str) -> None:
    with pytest.raises(AutoplanError, match=needle):
        BatchFeed(_spec(), [batch]).next_batch()


def test_a_one_shot_iterator_ends_the_run_when_it_ends() -> None:
    feed = BatchFeed(_spec(), iter([(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))]))
    feed.next_batch()
    with pytest.raises(AutoplanError, match="the batches ran out after 1 batch"):
        feed.next_batch()


def test_without_batches_every_step_trains_on_the_example_inputs() -> None:
    spec = _spec()
    feed = BatchFeed(spec, find_batches(types.SimpleNamespace(), "model.py"))
    assert feed.next_batch() == spec.example_inputs and "example inputs every step" in feed.source


@pytest.mark.parametrize("value", [torch.zeros(3), 7])
def test_batches_that_are_not_an_iterable_of_batches_are_refused(value) -> None:
    with pytest.raises(AutoplanError, match="batches must be an iterable of global batches"):
        find_batches(types.SimpleNamespace(batches=value), "model.py")
