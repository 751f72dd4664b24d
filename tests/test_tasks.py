"""Task YAMLs: parsing, rendering, labels, and the option-token rule."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from layerdiv.extract.tasks import (
    Instance,
    TaskError,
    builtin_tasks,
    data_sha256,
    instances,
    load_task,
    option_token_ids,
    parse_task,
    split_template,
)
from layerdiv.measurements import answer_spans
from layerdiv.schemas import MAX_OPTIONS

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


TEXT_ROWS = {
    "gsm8k-cot": {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"},
    "fineweb": {"text": "A web page."},
    "c4": {"text": "A web page."},
}


ANSWER_TASKS = ["math-levels", "mquake"]


def test_the_papers_eight_tasks_ship() -> None:
    assert builtin_tasks() == sorted([*PAPER_TASKS, *TEXT_ROWS, *ANSWER_TASKS])


@pytest.mark.parametrize("name", sorted(TEXT_ROWS))
def test_builtin_text_tasks_render_one_document_per_row(name: str, tmp_path: Path) -> None:
    spec = load_task(name)
    assert spec.kind == "text" and spec.max_tokens == 1024 and spec.dataset is not None
    assert spec.n == (20 if name == "gsm8k-cot" else 4800)
    rows = tmp_path / f"{name}.jsonl"
    rows.write_text(json.dumps(TEXT_ROWS[name]) + "\n")
    as_local = type(spec)(**{**spec.__dict__, "dataset": None, "data": str(rows)})
    (doc,) = instances(as_local)
    assert doc.gold == -1 and doc.group is None and "{{" not in doc.prompt
    assert TEXT_ROWS[name].get("text", "What is 2 + 2?") in doc.prompt


# Handwritten rows in the shape of the hub datasets (MQuAKE-Remastered: JSON; MATH: parquet).
MQUAKE_ROWS: list[dict[str, Any]] = [
    {
        "case_id": 1,
        "questions": ["In which city is the capital of the country of the Eiffel Tower?", "x"],
        "answer": "Paris",
        "orig_triples": [["Eiffel Tower", "country", "France"], ["France", "capital", "Paris"]],
    },
    {
        "case_id": 2,
        "questions": ["What currency is used where the river through Vienna reaches the sea?"],
        "answer": "the Romanian leu",
        "orig_triples": [
            ["Vienna", "river", "Danube"],
            ["Danube", "mouth", "Romania"],
            ["Romania", "currency", "Romanian leu"],
        ],
    },
]
MATH_ROWS: list[dict[str, Any]] = [
    {
        "problem": "Find x > 0 with x^2 = 4.",
        "level": "Level 2",
        "type": "Intermediate Algebra",
        "solution": "Since x > 0, x = \\boxed{2}.",
    },
    {
        "problem": "Solve x^3 = 27.",
        "level": "Level 5",
        "type": "Intermediate Algebra",
        "solution": "x = \\boxed{3}.",
    },
]


def as_local_file(name: str, tmp_path: Path) -> Any:
    """A built-in answer task reading its handwritten rows from a local file of the hub format."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    spec = load_task(name)
    if name == "mquake":
        path = tmp_path / "cf3k.json"
        path.write_text(json.dumps(MQUAKE_ROWS))
    else:
        path = tmp_path / "test-00000-of-00001.parquet"
        pq.write_table(pa.Table.from_pylist(MATH_ROWS), path)
    return type(spec)(**{**spec.__dict__, "dataset": None, "data": str(path)})


def test_answer_tasks_build_text_plus_answer_grouped(tmp_path: Path, tokenizer: Any) -> None:
    """mquake and math-levels: the document is the paper's prompt + answer, the group is hops or
    level, and the answer start counts the answer's own tokens from the end."""
    hops = instances(as_local_file("mquake", tmp_path))
    assert [d.prompt for d in hops] == [
        f"Question: {r['questions'][0]}\nAnswer: {r['answer']}" for r in MQUAKE_ROWS
    ]
    assert [(d.group, d.answer) for d in hops] == [("2", " Paris"), ("3", " the Romanian leu")]
    levels = instances(as_local_file("math-levels", tmp_path))
    assert [(d.group, d.answer) for d in levels] == [(r["level"][-1], " " + r["solution"])
                                                     for r in MATH_ROWS]  # fmt: skip
    assert levels[0].prompt.startswith("Problem: Find x") and "\nAnswer: Since" in levels[0].prompt
    docs = [*hops, *levels]
    for doc, (start, _, merged) in zip(docs, answer_spans(tokenizer, docs), strict=True):
        assert doc.answer is not None
        ids = tokenizer(doc.prompt)["input_ids"]
        assert len(ids) - start == len(tokenizer(doc.answer, add_special_tokens=False)["input_ids"])
        assert not merged and tokenizer.decode(ids[start:]).strip() == doc.answer.strip()
    # the answer enters the data hash; a text task without one keeps its hash and its spec dict
    assert data_sha256(hops) != data_sha256([Instance(d.prompt, -1, d.group) for d in hops])
    assert "answer" not in load_task("gsm8k-cot").to_dict()


def test_a_group_missing_from_a_row_is_named(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"body": "a", "level": 1}\n{"body": "b"}\n')
    spec = parse_task(
        {"name": "d", "kind": "text", "data": "d.jsonl", "text": "{{ body }}",
         "group_field": "level"}, tmp_path, "d",
    )  # fmt: skip
    with pytest.raises(TaskError, match=r"data row 1 .*'level'"):
        instances(spec)
    with pytest.raises(TaskError, match="belong to text tasks"):
        parse_task({"name": "d", "data": "d.jsonl", "answer": "{{ x }}"}, tmp_path, "d")


def test_a_txt_file_holds_one_document_per_line(tmp_path: Path) -> None:
    (tmp_path / "d.txt").write_text("first line\n\nsecond line\n")
    spec = parse_task(
        {"name": "d", "kind": "text", "data": "d.txt", "text": "{{ text }}"}, tmp_path, "d"
    )
    assert [d.prompt for d in instances(spec)] == ["first line", "second line"]
    with pytest.raises(TaskError, match="belong to text tasks"):
        parse_task({"name": "d", "data": "d.txt", "max_tokens": 5}, tmp_path, "d")


@pytest.mark.parametrize("name", PAPER_TASKS)
def test_builtin_templates_render(name: str, tmp_path: Path) -> None:
    """Each built-in template renders a row of its dataset's shape; the gold label resolves."""
    spec = load_task(name)
    assert spec.n == 2000 and spec.dataset is not None
    local = tmp_path / f"{name}.jsonl"
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


BAD_DATA: dict[str, tuple[str, bytes]] = {
    # name: (data file, its bytes); each file's second data row is the bad one
    "not_utf8": ("r.csv", b"text,sentiment\ngood film,positive\ncaf\xe9 film,negative\n"),
    "missing_field": ("r.jsonl", b'{"text": "good", "sentiment": "positive"}\n{"sentiment": 0}'),
    "null_field": ("r.jsonl", b'{"text": "good", "sentiment": "positive"}\n{"text": null}\n'),
    "cut_line": ("r.jsonl", b'{"text": "good", "sentiment": "positive"}\n{"text": "ba\n'),
    "json_cut": ("r.json", b'[{"text": "good", "sentiment": "positive"},\n {"text": \n'),
}
BAD_DATA_MESSAGE = {
    "not_utf8": "r.csv: line 3: byte 0xe9 is not UTF-8 text",
    "missing_field": "data row 1 of {folder}/r.jsonl: 'text' is undefined (its fields: sentiment)",
    "null_field": "data row 1 of {folder}/r.jsonl: a field used here is null",
    "cut_line": "r.jsonl: line 2 is not one complete JSON object",
    "json_cut": "r.json: line 3: not valid JSON",
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_data_is_an_error_naming_file_and_line(
    case: str, tmp_path: Path, make_task: Any
) -> None:
    """Undecodable bytes, missing or null fields and cut lines never become prompt text."""
    name, data = BAD_DATA[case]
    folder = tmp_path / "task"
    path = make_task(folder, data=name)
    (folder / name).write_bytes(data)
    message = BAD_DATA_MESSAGE[case].format(folder=folder)
    with pytest.raises(TaskError) as err:
        instances(load_task(str(path)))
    assert message in str(err.value)


def test_good_csv_and_jsonl_rows_read_as_text(tmp_path: Path, make_task: Any) -> None:
    folder, template = tmp_path / "task", "{{ text }} Answer: {{ answer }}"
    path = make_task(folder, data="r.csv", label="{{ label }}", template=template)
    (folder / "r.csv").write_bytes("\ufefftext,label\ncafé film,1\n".encode())  # BOM, as Excel
    assert instances(load_task(str(path)))[0] == Instance("café film Answer:", 1)
    path = make_task(folder, data="r.jsonl", template=template)
    (folder / "r.jsonl").write_text('{"text": "a\u2028b", "sentiment": "negative"}\n\n')
    assert instances(load_task(str(path)))[0].prompt == "a\u2028b Answer:"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"template": "{{ text } Answer: {{ answer }}"}, "the template is not valid Jinja (line 1"),
        ({"label": "{{ sentiment"}, "the label is not valid Jinja (line 1"),
        ({"filter": "{% if %}"}, "the filter is not valid Jinja (line 1"),
        ({"n": "abc"}, "'n' must be a positive whole number, got 'abc'"),
        ({"n": 0}, "'n' must be a positive whole number, got 0"),
        ({"options": [f"o{i}" for i in range(128)]}, "128 options; a task may have at most 127"),
    ],
)
def test_bad_task_yaml_is_refused_when_loaded(
    override: dict[str, Any], message: str, tmp_path: Path, make_task: Any
) -> None:
    with pytest.raises(TaskError, match=re.escape(message)):
        load_task(str(rewrite(make_task(tmp_path), **override)))


def rewrite(task_yaml: Path, **keys: Any) -> Path:
    """``task_yaml`` with ``keys`` set (its data file unchanged)."""
    task_yaml.write_text(json.dumps({**json.loads(task_yaml.read_text()), **keys}))
    return task_yaml


def test_127_options_are_accepted(tmp_path: Path, make_task: Any) -> None:
    spec = load_task(str(make_task(tmp_path, options=[f"o{i}" for i in range(127)], label="3")))
    assert len(spec.options) == MAX_OPTIONS and instances(spec)[0].gold == 3


CLI_CASES: dict[str, dict[str, Any]] = {
    "not_utf8": {"data": "r.csv"},
    "missing_field": {"data": "r.jsonl"},
    "cut_line": {"data": "r.jsonl"},
    "syntax": {"label": "{{ sentiment"},
    "n": {"n": "abc"},
    "k": {"options": [f"o{i}" for i in range(200)]},
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_extract_refuses_bad_task_inputs_in_one_line_and_writes_nothing(
    case: str, tmp_path: Path, make_task: Any, model_dirs: Any
) -> None:
    from click.testing import CliRunner

    from layerdiv.cli import main

    folder = tmp_path / "task"
    overrides = CLI_CASES[case]
    path = rewrite(make_task(folder), **overrides)
    if case in BAD_DATA:
        (folder / BAD_DATA[case][0]).write_bytes(BAD_DATA[case][1])
    before = {p: p.read_bytes() for p in folder.iterdir()}
    store = tmp_path / "store"
    args = ["extract", "--model", str(model_dirs("llama")), "--task", str(path),
            "--store", str(store)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and result.exception is not None, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert not store.exists()
    assert {p: p.read_bytes() for p in folder.iterdir()} == before


def text_spec(folder: Path, data: str, content: bytes, **keys: Any) -> Path:
    """A text task YAML over the data file ``data`` holding ``content``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / data).write_bytes(content)
    spec = {"name": "docs", "kind": "text", "text": "{{ text }}", "data": data, **keys}
    (folder / "docs.yaml").write_text(json.dumps(spec))
    return folder / "docs.yaml"


def test_a_list_or_object_in_a_text_field_is_refused_naming_the_row(tmp_path: Path) -> None:
    def jsonl(*texts: Any) -> bytes:
        return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()

    path = text_spec(tmp_path, "d.jsonl", jsonl("fine", ["good", "film"]))
    with pytest.raises(TaskError, match=r"data row 1 of .*d.jsonl: a field used here is a list"):
        instances(load_task(str(path)))
    path = text_spec(tmp_path, "e.jsonl", jsonl("fine", "ok", {"a": 1}))
    with pytest.raises(TaskError, match=r"data row 2 of .*: a field used here is an object"):
        instances(load_task(str(path)))
    joined = text_spec(tmp_path, "f.jsonl", jsonl(["good", "film"]), text='{{ text | join(" ") }}')
    assert [i.prompt for i in instances(load_task(str(joined)))] == ["good film"]


def test_crlf_text_files_keep_no_carriage_return(tmp_path: Path) -> None:
    path = text_spec(tmp_path, "d.txt", b"first line\r\nsecond line\r\n\r\n")
    assert [i.prompt for i in instances(load_task(str(path)))] == ["first line", "second line"]


def test_a_missing_group_field_names_the_row_and_the_field(tmp_path: Path) -> None:
    rows = b'{"text": "a", "level": 1}\n{"text": "b"}\n'
    path = text_spec(tmp_path, "d.jsonl", rows, group_field="level")
    with pytest.raises(TaskError, match=r"data row 1 of .*: no field 'level' \(the task's group"):
        instances(load_task(str(path)))


def test_data_files_is_the_alias_of_data(tmp_path: Path) -> None:
    path = text_spec(tmp_path, "d.jsonl", b'{"text": "a"}\n')
    spec = json.loads(path.read_text())
    spec["data_files"] = spec.pop("data")
    path.write_text(json.dumps(spec))
    assert [i.prompt for i in instances(load_task(str(path)))] == ["a"]
    path.write_text(json.dumps({**spec, "data": "d.jsonl"}))
    with pytest.raises(TaskError, match="give 'data' or its alias 'data_files', not both"):
        load_task(str(path))
