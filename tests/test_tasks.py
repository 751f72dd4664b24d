"""Task YAMLs: parsing, rendering, labels, and the option-token rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from layerdiv.extract.tasks import (
    TaskError,
    builtin_tasks,
    instances,
    load_task,
    option_token_ids,
    split_template,
)

PAPER_TASKS = ["ag_news", "arc", "boolq", "mnli", "qqp", "rte", "sst2", "wic"]
FAKE_ROWS: dict[str, dict[str, Any]] = {
    "ag_news": {"text": "Stocks rose.", "label": 2},
    "arc": {
        "question": "Which is a gas?",
        "choices": {"text": ["ice", "steam", "rock", "wood"], "label": ["1", "2", "3", "4"]},
        "answerKey": "2",
    },
    "boolq": {"passage": "Water is wet.", "question": "is water wet", "label": 1},
    "mnli": {"premise": "A man sleeps.", "hypothesis": "A man rests.", "label": 0},
    "qqp": {"question1": "How old?", "question2": "What age?", "label": 1},
    "rte": {"sentence1": "It rains.", "sentence2": "It is wet.", "label": 0},
    "sst2": {"sentence": "a fine film", "label": 1},
    "wic": {"word": "bank", "sentence1": "A river bank.", "sentence2": "A bank loan.", "label": 0},
}
GOLD = {"ag_news": 2, "arc": 1, "boolq": 1, "mnli": 0, "qqp": 1, "rte": 0, "sst2": 1, "wic": 0}


def test_the_papers_eight_tasks_ship() -> None:
    assert builtin_tasks() == PAPER_TASKS


@pytest.mark.parametrize("name", PAPER_TASKS)
def test_builtin_templates_render(name: str, tmp_path: Path) -> None:
    """Each built-in template renders a row of its dataset's shape; the gold label resolves."""
    spec = load_task(name)
    assert spec.n == 2000 and spec.dataset is not None
    local = tmp_path / f"{name}.jsonl"
    import json

    local.write_text(json.dumps(FAKE_ROWS[name]) + "\n")
    as_local = type(spec)(**{**spec.__dict__, "dataset": None, "data": str(local)})
    (item,) = instances(as_local)
    assert item.gold == GOLD[name]
    assert not item.prompt.endswith(" ") and "{{" not in item.prompt
    if name == "arc":
        assert "B: steam\n" in item.prompt and item.prompt.endswith("Answer:")


def test_option_tokens_keep_the_leading_space(
    tokenizer: Any, tmp_path: Path, make_task: Any
) -> None:
    """Byte-level BPE: the scored token is the one for ' negative' (with its space)."""
    spec = load_task(str(make_task(tmp_path)))
    prompt = instances(spec)[0].prompt
    ids = option_token_ids(spec, tokenizer, prompt)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert all(t.startswith("Ġ") for t in tokens), tokens
    assert tokenizer.convert_ids_to_tokens(tokenizer(" negative")["input_ids"])[0] == tokens[0]


def test_option_tokens_with_a_sentencepiece_style_tokenizer(tmp_path: Path, make_task: Any) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "▁Answer", ":", "▁negative", "▁positive",
                                         "negative", "positive", "▁Was", "▁that"])}  # fmt: skip
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", continuing_subword_prefix=""))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    spec = load_task(str(make_task(tmp_path)))
    ids = option_token_ids(spec, fast, "Was that Answer:")
    assert fast.convert_ids_to_tokens(ids) == ["▁negative", "▁positive"]


def test_options_sharing_a_first_token_are_named(
    tokenizer: Any, tmp_path: Path, make_task: Any
) -> None:
    spec = load_task(str(make_task(tmp_path, options=["bad", "badly"], label="0")))
    with pytest.raises(TaskError, match="'bad' and 'badly' start with the same token"):
        option_token_ids(spec, tokenizer, "Answer:")


def test_newline_before_the_answer_stays_in_the_prompt(tmp_path: Path, make_task: Any) -> None:
    spec = load_task(str(make_task(tmp_path, template="{{ text }}\nAnswer:\n{{ answer }}")))
    _, sep = split_template(spec)
    assert sep == "" and instances(spec)[0].prompt.endswith("Answer:\n")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"template": "{{ text }} Answer:"}, "must end with"),
        ({"options": ["yes"]}, "at least two distinct"),
        ({"colour": "red"}, "unknown keys"),
        ({"label": "{{ missing_field }}"}, "data row 0"),
        ({"label": "maybe"}, "neither an option"),
        ({"data": "nowhere.jsonl"}, "does not exist"),
        ({"name": "bad/name"}, "not usable as a directory name"),
        ({"filter": "{{ False }}"}, "no instances"),
    ],
)
def test_bad_task_files_say_what_is_wrong(
    override: dict[str, Any], message: str, tmp_path: Path, make_task: Any
) -> None:
    with pytest.raises(TaskError, match=message):
        instances(load_task(str(make_task(tmp_path, **override))))


def test_unknown_task_lists_builtins() -> None:
    with pytest.raises(TaskError, match="one of ag_news, arc"):
        load_task("sst3")
