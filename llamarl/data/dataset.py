"""The run's prompt data: training examples and held-out examples (never trained on), from the
embedded synthetic task (data.path = "") or from local files.

Held-out split of a file dataset:
  * data.eval_path given: its first data.eval_prompts valid rows;
  * otherwise: the data.eval_prompts distinct prompts of data.path with the smallest sha1 of
    their text. The rule depends only on the texts, not on row order, seed or engine count.
  In both cases every training row whose prompt text is also held out is dropped, so no held-out
  prompt is ever trained on (duplicates included).

Malformed rows (unparsable, missing or non-string prompt, empty prompt, missing answer):
data.on_bad_row = "skip" skips and counts them (`BadRows`); "raise" stops with a one-line
ValueError naming the file, the row and the problem. A field that no row has at all is a
configuration mistake, not a bad row: it raises whatever on_bad_row says.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from llamarl.config import DataConfig
from llamarl.data.prompts import MISSING, BadRowError, lookup, row_to_example
from llamarl.data.sources import BadRow, column_names, read_rows, row_label
from llamarl.tiny import lookup as tiny_lookup
from llamarl.tiny import task as tiny_task
from llamarl.tiny.task import Example

SYNTHETIC_TRAIN_POOL = 50_000  # distinct training prompts generated for the synthetic task


@dataclass
class BadRows:
    """Malformed rows skipped in one file: how many, and the first one (for the log)."""

    path: str
    count: int = 0
    first: str = ""  # e.g. "line 3: not valid JSON (...)"

    def add(self, where: str, reason: str) -> None:
        self.count += 1
        if not self.first:
            self.first = f"{where}: {reason}"

    def summary(self) -> str:
        return (f"{self.path}: skipped {self.count} malformed row(s) (data.on_bad_row=skip); "
                f"first: {self.first}")


@dataclass
class PromptData:
    train: list[Example]
    held_out: list[Example]
    bad_rows: list[BadRows] = field(default_factory=list)  # one per file read
    notes: list[str] = field(default_factory=list)  # start-up log lines

    @property
    def bad_row_count(self) -> int:
        return sum(b.count for b in self.bad_rows)


def load_prompt_data(cfg: DataConfig, seed: int) -> PromptData:
    """Every engine calls this with the same arguments and gets the same result."""
    if not cfg.path:
        tasks = {"reverse": tiny_task, "lookup": tiny_lookup}
        if cfg.task not in tasks:
            raise ValueError(f"data.task {cfg.task!r} is unknown: the embedded tasks are "
                             "'reverse' and 'lookup' (or set data.path to a dataset file)")
        task = tasks[cfg.task]
        return PromptData(task.sample_examples(SYNTHETIC_TRAIN_POOL, "train", seed),
                          task.sample_examples(cfg.eval_prompts, "eval", seed))
    train, bad = read_examples(cfg.path, cfg.prompt_field, cfg.answer_field, cfg.on_bad_row)
    data = PromptData([], [], [bad])
    if cfg.eval_path:
        held_out, eval_bad = read_examples(cfg.eval_path, cfg.prompt_field, cfg.answer_field,
                                           cfg.on_bad_row)
        data.bad_rows.append(eval_bad)
        data.held_out = held_out[:cfg.eval_prompts]
    else:
        distinct = len({ex.prompt for ex in train})
        if distinct <= cfg.eval_prompts:
            raise ValueError(f"data.path {cfg.path!r} has {distinct} distinct valid prompts, "
                             f"not more than data.eval_prompts = {cfg.eval_prompts}: lower "
                             "data.eval_prompts or give a separate data.eval_path")
        data.held_out = hold_out(train, cfg.eval_prompts)
    eval_texts = {ex.prompt for ex in data.held_out}
    data.train = [ex for ex in train if ex.prompt not in eval_texts]
    if not data.train:
        raise ValueError(f"data.path {cfg.path!r} has no training row left: every valid row's "
                         "prompt is also held out; use a different data.eval_path")
    repeats = len(train) - len(data.train) - (0 if cfg.eval_path else len(data.held_out))
    data.notes.append(
        f"prompts: {len(data.train)} train from {cfg.path}, {len(data.held_out)} held out "
        f"from {cfg.eval_path or cfg.path}"
        + (f"; {repeats} train row(s) repeating a held-out prompt dropped" if repeats else ""))
    data.notes.extend(b.summary() for b in data.bad_rows if b.count)
    return data


def hold_out(examples: list[Example], n: int) -> list[Example]:
    """The `n` distinct prompts with the smallest sha1 of their text (each at its first
    occurrence, in file order)."""
    first: dict[str, int] = {}
    for i, ex in enumerate(examples):
        first.setdefault(ex.prompt, i)
    texts = sorted(first, key=lambda t: hashlib.sha1(t.encode()).digest())[:n]
    return [examples[i] for i in sorted(first[t] for t in texts)]


def read_examples(path: str, prompt_field: str, answer_field: str, on_bad_row: str
                  ) -> tuple[list[Example], BadRows]:
    """The valid examples of one file, in file order, and the malformed rows skipped."""
    fields = [f for f in (prompt_field, answer_field) if f]
    columns = column_names(path)
    if columns is not None:
        for key, f in (("data.prompt_field", prompt_field), ("data.answer_field", answer_field)):
            if f and f not in columns and f.split(".")[0] not in columns:
                raise ValueError(f"{key} {f!r} is not a column of {path} (columns: "
                                 f"{', '.join(columns)}): set {key} to one of them")
        columns = sorted({f if f in columns else f.split(".")[0] for f in fields})
    label = row_label(path)
    bad = BadRows(path)
    examples: list[Example] = []
    seen_fields = {f: False for f in fields}
    first_keys: list[str] | None = None
    for number, row in read_rows(path, columns):
        try:
            if isinstance(row, BadRow):
                raise BadRowError(row.reason)
            if first_keys is None:
                first_keys = list(row)
            examples.append(row_to_example(row, prompt_field, answer_field))
        except BadRowError as e:
            if on_bad_row == "raise":
                raise ValueError(f"{path} {label} {number}: {e}: fix the row or set "
                                 "data.on_bad_row=skip to skip malformed rows") from None
            bad.add(f"{label} {number}", str(e))
        if not isinstance(row, BadRow):
            for f in fields:
                seen_fields[f] = seen_fields[f] or lookup(row, f) is not MISSING
    for key, f in (("data.prompt_field", prompt_field), ("data.answer_field", answer_field)):
        if f and first_keys is not None and not seen_fields[f]:
            raise ValueError(f"{key} {f!r} is in no row of {path} (the first row has "
                             f"{', '.join(first_keys) or 'no fields'}): set {key} to one of them")
    if not examples:
        raise ValueError(f"{path} has no valid row ({bad.count} malformed; first: "
                         f"{bad.first or 'the file is empty'}): check the file and data.*_field")
    return examples, bad

