"""Prompt datasets: the three file formats, the field mapping, the chat template, malformed rows
(skipped and counted, or raised), the held-out split, per-engine sharding and the loader's
resumable state."""

from __future__ import annotations

import json
import random

import pytest

from llamarl.config import DataConfig, load_config
from llamarl.data.dataset import hold_out, load_prompt_data, read_examples
from llamarl.data.loader import PromptLoader, shard
from llamarl.data.prompts import MISSING, PromptFormatter, lookup, row_to_example
from llamarl.data.sources import detect_format, read_rows
from llamarl.tiny.model import build_tokenizer
from llamarl.tiny.task import Example

ROWS = [{"question": "abc=", "target": "cba"}, {"question": "ab=", "target": "ba"},
        {"question": "lkj=", "target": "jkl"}]


def write_jsonl(path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


# --- formats ---------------------------------------------------------------------------------

def test_jsonl_rows_with_line_numbers_and_unreadable_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], "{not json", "", "[1, 2]", ROWS[1]])
    rows = list(read_rows(path))
    assert [n for n, _ in rows] == [1, 2, 4, 5]  # the blank line 3 is not a row
    assert rows[0][1] == ROWS[0] and rows[3][1] == ROWS[1]
    assert "not valid JSON" in rows[1][1].reason and "not an object" in rows[2][1].reason


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert detect_format(path) == "parquet"
    assert [r for _, r in read_rows(path, ["question"])] == [{"question": r["question"]}
                                                            for r in ROWS]
    examples, bad = read_examples(str(path), "question", "target", "raise")
    assert [(e.prompt, e.answer) for e in examples] == [("abc=", "cba"), ("ab=", "ba"),
                                                        ("lkj=", "jkl")]
    assert bad.count == 0


def test_save_to_disk_directory_read_without_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    nested = [{"meta": {"q": r["question"]}, "target": r["target"]} for r in ROWS]
    ds = datasets.Dataset.from_list(nested * 2).select([5, 4, 0])  # indices are flattened
    ds.save_to_disk(str(tmp_path / "ds"))
    assert detect_format(tmp_path / "ds") == "arrow_dir"
    examples, _ = read_examples(str(tmp_path / "ds"), "meta.q", "target", "raise")
    assert [e.prompt for e in examples] == ["lkj=", "ab=", "abc="]

    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict.*'train', 'test'.*dd/train"):
        detect_format(tmp_path / "dd")


@pytest.mark.parametrize("name, words", [
    ("missing.jsonl", ["does not exist"]), ("d.csv", ["unknown format", ".csv", ".parquet"]),
])
def test_unknown_or_missing_files_are_one_line_errors(tmp_path, name, words):
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError) as e:
        detect_format(tmp_path / name)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value)


def test_recipe_keys_are_validated(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = load_config(None, [f"data.path={path}", "data.prompt_field=question"])
    assert cfg.data.path == path and cfg.data.on_bad_row == "skip"
    for override, words in [
        ([f"data.path={tmp_path}/nope.jsonl"], ["'data.path'", "nope.jsonl", "does not exist"]),
        ([f"data.eval_path={path}"], ["'data.eval_path'", "needs data.path"]),
        (["data.system_prompt=be brief"], ["'data.system_prompt'", "chat_template=true"]),
        (["data.on_bad_row=ignore"], ["'data.on_bad_row'", "skip, raise"]),
        (["data.task=sorting"], ["'data.task'", "data.path"]),
        ([f"data.path={path}", "data.prompt_field="], ["'data.prompt_field'"]),
    ]:
        with pytest.raises(ValueError) as e:
            load_config(None, override)
        assert all(w in str(e.value) for w in words), (override, str(e.value))


# --- field mapping and malformed rows --------------------------------------------------------

def test_field_lookup_follows_dotted_paths():
    row = {"a": {"b": [{"c": "x"}]}, "d.e": "literal", "n": 3}
    assert lookup(row, "a.b.0.c") == "x"
    assert lookup(row, "d.e") == "literal"  # a key with a dot is found as written
    assert lookup(row, "a.b.1.c") is MISSING and lookup(row, "a.z") is MISSING
    assert row_to_example({"q": "hi", "a": 42}, "q", "a") == Example("hi", "42")
    assert row_to_example({"q": "hi"}, "q", "") == Example("hi", "")  # no answer field


@pytest.mark.parametrize("row, reason", [
    ({"target": "x"}, "no prompt field 'question'"),
    ({"question": 7, "target": "x"}, "is a int, not a string"),
    ({"question": "  ", "target": "x"}, "is empty"),
    ({"question": "ab="}, "no answer field 'target'"),
    ({"question": "ab=", "target": None}, "no answer field 'target'"),
    ({"question": "ab=", "target": ["b"]}, "is a list"),
])
def test_malformed_rows_name_the_problem(row, reason):
    with pytest.raises(ValueError, match=reason):
        row_to_example(row, "question", "target")


def test_bad_rows_are_skipped_and_counted(tmp_path):
    lines = [ROWS[0], "{oops", {"question": "", "target": "x"}, ROWS[1], {"question": "b="}]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    examples, bad = read_examples(path, "question", "target", "skip")
    assert [e.prompt for e in examples] == ["abc=", "ab="]
    assert bad.count == 3
    assert bad.first.startswith("line 2: not valid JSON")
    assert "skipped 3 malformed row(s)" in bad.summary() and path in bad.summary()


def test_bad_row_raises_naming_file_line_and_problem(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], ROWS[1], {"question": 5, "target": "x"}])
    with pytest.raises(ValueError) as e:
        read_examples(path, "question", "target", "raise")
    msg = str(e.value)
    assert f"{path} line 3" in msg and "not a string" in msg and "on_bad_row=skip" in msg
    assert "\n" not in msg


def test_a_field_in_no_row_is_a_configuration_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"data.prompt_field 'prompt' is in no row.*question"):
        read_examples(path, "prompt", "target", "skip")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"data.answer_field 'answer' is not a column.*target"):
        read_examples(str(tmp_path / "d.parquet"), "question", "answer", "skip")


# --- tokenisation and chat template ----------------------------------------------------------

def test_plain_prompts_are_bos_plus_text():
    tok = build_tokenizer()
    (p,) = PromptFormatter(tok).encode([Example("abc=", "cba")])
    assert p.token_ids == [tok.bos_token_id] + tok.encode("abc=", add_special_tokens=False)
    assert (p.text, p.answer) == ("abc=", "cba")


def test_chat_template_wraps_the_prompt_as_a_user_message():
    tok = build_tokenizer()
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] }} "
                         "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}="
                         "{% endif %}")
    fmt = PromptFormatter(tok, chat_template=True, system_prompt="hi")
    assert fmt.text("abc") == "<bos>s hiu abc="
    (p,) = fmt.encode([Example("abc", "cba")])
    assert p.token_ids == tok.encode("<bos>s hiu abc=", add_special_tokens=False)
    assert p.token_ids.count(tok.bos_token_id) == 1  # the template's BOS, not doubled
    assert p.text == "abc"  # reward functions see the prompt as written


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_gsm8k_style_parquet_with_a_chatml_template_and_no_bos(tmp_path):
    """The shape of a GSM8K recipe: Parquet with question/answer, chat_template: true, and a
    Qwen-style tokenizer (ChatML, no BOS token)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "12+3", "answer": "15 #### 15"}, {"question": "2*4", "answer": "8 #### 8"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    examples, _ = read_examples(str(tmp_path / "train.parquet"), "question", "answer", "raise")
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.bos_token = None
    tok.chat_template = CHATML
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    fmt = PromptFormatter(tok, chat_template=True)
    text = "<|im_start|>user\n12+3<|im_end|>\n<|im_start|>assistant\n"
    assert fmt.text("12+3") == text
    p = fmt.encode(examples)[0]
    assert p.token_ids == tok.encode(text, add_special_tokens=False)
    assert p.token_ids[0] == start and p.token_ids.count(start) == 2 and end in p.token_ids
    assert (p.text, p.answer) == ("12+3", "15 #### 15")
    plain = PromptFormatter(tok).encode(examples)[0]  # no BOS to prepend
    assert plain.token_ids == tok.encode("12+3", add_special_tokens=False)


def test_chat_template_without_one_in_the_tokenizer_is_refused():
    with pytest.raises(ValueError, match="has no chat template.*chat_template=false"):
        PromptFormatter(build_tokenizer(), chat_template=True, model="models/tiny")


# --- held-out split, sharding, loader state --------------------------------------------------

def test_held_out_rows_are_never_trained_on(tmp_path):
    rows = [{"question": f"{c}=", "target": c} for c in "abcdefghijkl"]
    rows.insert(5, dict(rows[0]))  # a duplicate prompt
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(path=path, prompt_field="question", answer_field="target", eval_prompts=4)
    data = load_prompt_data(cfg, seed=0)
    held = [e.prompt for e in data.held_out]
    assert len(set(held)) == 4 and not set(held) & {e.prompt for e in data.train}
    assert len(data.train) == 13 - 4 - ("a=" in held)  # a duplicate follows its twin
    assert {e.prompt for e in data.train} | set(held) == {r["question"] for r in rows}
    # The rule depends on the texts only: not on the seed, nor on the row order.
    assert load_prompt_data(cfg, seed=1).held_out == data.held_out
    shuffled = write_jsonl(tmp_path / "s.jsonl", rows[::-1])
    again = load_prompt_data(DataConfig(path=shuffled, prompt_field="question",
                                        answer_field="target", eval_prompts=4), seed=0)
    assert sorted(e.prompt for e in again.held_out) == sorted(held)
    assert hold_out(data.held_out + data.train, 4) == data.held_out


def test_eval_path_gives_the_first_rows_and_bad_rows_are_totalled(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", ROWS + ["oops"])
    evals = write_jsonl(tmp_path / "e.jsonl", [{"question": "zz="}, {"question": "ab=",
                                                                     "target": "ba"},
                                               {"question": "k=", "target": "k"}])
    cfg = DataConfig(path=train, eval_path=evals, prompt_field="question",
                     answer_field="target", eval_prompts=1)
    data = load_prompt_data(cfg, seed=0)
    assert [e.prompt for e in data.held_out] == ["ab="]
    assert [e.prompt for e in data.train] == ["abc=", "lkj="]  # "ab=" is held out
    assert data.bad_row_count == 2
    assert any("1 train row(s) repeating a held-out prompt" in n for n in data.notes)


def test_synthetic_task_is_the_default():
    data = load_prompt_data(DataConfig(eval_prompts=8), seed=0)
    assert len(data.train) == 50_000 and len(data.held_out) == 8 and data.bad_row_count == 0


def test_shards_are_disjoint_and_cover_the_data():
    assert [shard(list(range(7)), e, 3) for e in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    with pytest.raises(ValueError, match="engine 2 got no prompts"):
        shard([0, 1], 2, 3)


def test_loader_order_is_a_seeded_shuffle_per_epoch():
    loader = PromptLoader(list("abcde"), seed=0)
    first, second = loader.next(5), loader.next(5)
    order0, order1 = list(range(5)), list(range(5))
    random.Random("0:0").shuffle(order0)
    random.Random("0:1").shuffle(order1)
    assert first == [list("abcde")[i] for i in order0] == list("cdbae")
    assert second == [list("abcde")[i] for i in order1]
    assert loader.epoch == 1


@pytest.mark.parametrize("drawn", [3, 5, 12])  # mid-epoch, at an epoch's end, later epochs
def test_loader_state_restores_the_exact_continuation(drawn):
    prompts = list(range(5))
    a = PromptLoader(prompts, seed=3, shard_index=1, shards=2)
    a.next(drawn)
    state = json.loads(json.dumps(a.state_dict()))  # travels as JSON (buffer, meta.json)
    expected = a.next(9)
    b = PromptLoader(prompts, seed=3, shard_index=1, shards=2)
    b.load_state_dict(state)
    assert b.next(9) == expected
    with pytest.raises(ValueError, match="data position is for prompt shard"):
        PromptLoader(prompts, seed=3, shard_index=0, shards=2).load_state_dict(state)


def test_a_file_that_is_not_parquet_is_named_in_one_line(tmp_path):
    from llamarl.data.sources import column_names, read_rows

    fake = tmp_path / "train.parquet"
    fake.write_text('{"prompt": "x"}\n')
    for read in (lambda: column_names(fake), lambda: list(read_rows(fake))):
        with pytest.raises(ValueError, match=r"train.parquet' is not a readable Parquet file .*"
                                             r"give it the suffix of its real format"):
            read()
