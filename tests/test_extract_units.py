"""The pieces of extraction on their own: batching, the chunk grid with shards, the
out-of-memory halving path and component naming."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from layerdiv.analyze.synthetic import component_infos
from layerdiv.extract.adapters import adapter_for
from layerdiv.extract.batching import MAX_BATCH_ROWS, batches, chunk_runs, tokenize
from layerdiv.extract.forward import ModelRunner
from layerdiv.extract.models import LoadedModel, ModelSource
from layerdiv.schemas import component_names
from tests.tolerance import assert_within


def test_fixed_batches_are_longest_first() -> None:
    lengths = [3, 9, 5, 9, 1]
    assert batches(lengths, [0, 1, 2, 3, 4], 2, budget=0) == [[1, 3], [2, 0], [4]]
    assert batches(lengths, [4, 0], 2, budget=0) == [[0, 4]]


def test_auto_batches_respect_budget_padding_and_row_cap() -> None:
    lengths = [10] * 6 + [9, 7]
    # Budget 40 padded tokens: four rows of width 10 per batch; 9 is within 20 % padding of
    # 10, 7 is not and opens its own batch.
    assert batches(lengths, list(range(8)), None, budget=40) == [
        [0, 1, 2, 3],
        [4, 5, 6],
        [7],
    ]
    many = [1] * (MAX_BATCH_ROWS + 5)
    out = batches(many, list(range(len(many))), None, budget=10**9)
    assert [len(b) for b in out] == [MAX_BATCH_ROWS, 5]


def test_chunk_grid_runs_and_shards() -> None:
    todo = [0, 1, 2, 5, 6, 7, 8, 9, 12]
    assert chunk_runs(todo, 4) == {0: [[0, 1, 2]], 1: [[5, 6, 7]], 2: [[8, 9]], 3: [[12]]}
    assert chunk_runs(todo, 4, (1, 2)) == {1: [[5, 6, 7]], 3: [[12]]}
    assert chunk_runs(todo, 4, (0, 2)) == {0: [[0, 1, 2]], 2: [[8, 9]]}
    # Every instance is in exactly one shard's chunks.
    for n in (1, 2, 3):
        ids = sorted(
            i
            for k in range(n)
            for runs in chunk_runs(list(range(50)), 7, (k, n)).values()
            for r in runs
            for i in r
        )
        assert ids == list(range(50))
    assert chunk_runs([], 4) == {}


def test_tokenize_keeps_the_end_and_the_bos(tokenizer: Any) -> None:
    prompt = " ".join(["movie"] * 30)
    full = tokenizer(prompt)["input_ids"]
    seqs, truncated = tokenize(tokenizer, [prompt, "the film"], context_length=10)
    assert truncated == [True, False]
    assert len(seqs[0]) == 10 and seqs[0] == full[-10:]  # no BOS added by this tokenizer
    assert seqs[1] == tokenizer("the film")["input_ids"]


def _runner(model: Any, tokenizer: Any, budget: int) -> ModelRunner:
    source = ModelSource("tiny", "tiny", None, "test", model.config, False)
    loaded = LoadedModel(source, model, tokenizer, torch.device("cpu"), torch.float32)
    return ModelRunner(loaded, adapter_for(model.config), [11, 25], budget)


@pytest.mark.numerical
@pytest.mark.parametrize("batch_size", [None, 8])
def test_out_of_memory_halves_the_batch_and_the_budget(
    batch_size: int | None, build_model: Any, tokenizer: Any
) -> None:
    model = build_model("llama")
    seqs = [[5, 17, 33, 40, 41, 42, 60, 7]] * 8
    with _runner(model, tokenizer, budget=64) as runner:
        want = {i: dec.logits[row] for dec, b in runner.run_chunk(seqs, list(range(8)), None)
                for row, i in enumerate(b)}  # fmt: skip
        forward, rows = model.forward, []

        def small_memory(*args: Any, **kwargs: Any) -> Any:
            rows.append(kwargs["input_ids"].shape[0])
            if rows[-1] > 2 or kwargs["input_ids"].shape[1] == 3:
                raise torch.OutOfMemoryError("CUDA out of memory (test)")
            return forward(*args, **kwargs)

        model.forward = small_memory
        got = {i: dec.logits[row] for dec, b in runner.run_chunk(seqs, list(range(8)), batch_size)
               for row, i in enumerate(b)}  # fmt: skip
        assert rows[:3] == [8, 4, 2]
        assert sum(r for r in rows if r <= 2) == 8  # each instance ran once, in halves
        assert sorted(got) == list(range(8))
        for i in range(8):  # halved batches run other kernels: within FLOAT32 of the scale
            assert_within(got[i], want[i], want[i].abs().max(), what=f"instance {i}")
        if batch_size is None:
            assert runner.budget == 2 * 8  # kept for later chunks
        rows.clear()
        with pytest.raises(torch.OutOfMemoryError):  # one row that does not fit: give up
            list(runner.run_chunk([[5] * 3], [0], 1))
        assert rows == [1]
    del model.forward


def test_runner_removes_its_hooks_even_on_error(build_model: Any, tokenizer: Any) -> None:
    model = build_model("llama")

    def n_hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    with pytest.raises(RuntimeError, match="boom"), _runner(model, tokenizer, 64) as runner:
        assert n_hooks() > 0
        runner.run([[5, 6, 7]])
        raise RuntimeError("boom")
    assert n_hooks() == 0


def test_component_names_are_defined_once() -> None:
    calls = [("embed", -1), ("attn", 0), ("mlp", 0), ("attn", 0), ("mlp", 0), ("bias", -1)]
    assert component_names(calls) == ["embed", "attn.0", "mlp.0", "attn.0#1", "mlp.0#1", "bias"]
    infos = component_infos(["embed", "attn", "mlp", "attn", "mlp", "bias"])
    assert [c.name for c in infos] == ["embed", "attn.0", "mlp.0", "attn.1", "mlp.1", "bias"]
    assert [c.layer for c in infos] == [-1, 0, 0, 1, 1, -1]


@pytest.mark.parametrize(("name", "given"), [("igrad", {"igrad_steps": 2}), ("skips", {})])
def test_the_progress_moves_within_a_batch_of_a_measurement_of_many_passes(
    name: str, given: dict[str, Any], build_model: Any, tokenizer: Any
) -> None:
    """A batch of ``--igrad`` (passes per site and block) or ``--skips`` (a pass per block) tells
    the bar its share as it goes: more than one step per batch, never backwards, the batch's
    units in all."""
    from layerdiv.measurements import registered

    model = build_model("llama")
    source = ModelSource("tiny", "tiny", None, "test", model.config, False)
    loaded = LoadedModel(source, model, tokenizer, torch.device("cpu"), torch.float32)
    m = next(m for m in registered() if m.name == name)
    settings = {**m.defaults(), **given}
    seqs = [[5, 17, 33, 40, 41, 42, 60, 7]] * 4
    steps: list[float] = []
    with ModelRunner(loaded, adapter_for(model.config), [11, 25], 10**6, "choice",
                     {name: settings}, [0] * 4) as runner:  # fmt: skip
        batches_run = list(runner.run_chunk(seqs, list(range(4)), None, steps.append))
    assert len(batches_run) == 1  # one batch: the bar moved inside it
    assert len(steps) > 2 and min(steps) >= 0
    assert steps[0] < 4 and sum(steps) == pytest.approx(4)
