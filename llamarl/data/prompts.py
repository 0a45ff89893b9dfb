"""From a dataset row to the token ids the engine samples from: the field mapping, the optional
chat template, and tokenisation.

Field mapping: data.prompt_field / data.answer_field name a key of the row, or a dotted path into
nested objects and lists ("meta.question", "messages.0.content"). A key that itself contains a dot
is found as written first.

Formatting, for a prompt text x:
    chat_template = false:  [BOS] + tokens(x)        (BOS only if the tokenizer has one)
    chat_template = true:   tokens(apply_chat_template([system?, {"role": "user", "content": x}],
                                                       add_generation_prompt=True))
The template's text is tokenised without adding special tokens again (templates that want a BOS
write it themselves), so no BOS is ever doubled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamarl.tiny.task import Example


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]  # what the engine is given
    text: str  # the prompt field as written (passed to reward functions)
    answer: str  # the reference answer (passed to reward functions)
    # the dataset row (multi-turn environments read it)
    row: dict | None = field(default=None, compare=False, hash=False)


class BadRowError(ValueError):
    """A row that cannot become a prompt; the message says why."""


MISSING = object()  # lookup() of an absent field


def lookup(row, field: str):
    """`row[field]`, following a dotted path through dicts and lists; MISSING if absent."""
    if isinstance(row, dict) and field in row:
        return row[field]
    value = row
    for part in field.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return MISSING
    return value


def row_to_example(row: dict, prompt_field: str, answer_field: str) -> Example:
    """The (prompt, answer) of a row, or BadRowError naming the field and the problem.
    answer_field "" means the dataset has no reference answer (the answer is "")."""
    prompt = lookup(row, prompt_field)
    if prompt is MISSING or prompt is None:
        raise BadRowError(f"no prompt field {prompt_field!r}")
    if not isinstance(prompt, str):
        raise BadRowError(f"prompt field {prompt_field!r} is a {type(prompt).__name__}, "
                          "not a string")
    if not prompt.strip():
        raise BadRowError(f"prompt field {prompt_field!r} is empty")
    if not answer_field:
        return Example(prompt=prompt, answer="", row=row)
    answer = lookup(row, answer_field)
    if answer is MISSING or answer is None:
        raise BadRowError(f"no answer field {answer_field!r}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise BadRowError(f"answer field {answer_field!r} is a {type(answer).__name__}, "
                          "not a string or number")
    return Example(prompt=prompt, answer=str(answer), row=row)


class PromptFormatter:
    """Turns examples into engine prompts with one tokenizer, the same way for train and eval."""

    def __init__(self, tokenizer, chat_template: bool = False, system_prompt: str = "",
                 model: str = "the model"):
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"data.chat_template is true but the tokenizer of {model} has no "
                             "chat template: set data.chat_template=false or use a model whose "
                             "tokenizer_config.json defines chat_template")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system_prompt = system_prompt

    def text(self, prompt: str) -> str:
        """The text the model reads (before tokenisation, without the non-chat BOS)."""
        if not self.chat_template:
            return prompt
        messages = [{"role": "user", "content": prompt}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)

    def encode(self, examples: list[Example]) -> list[Prompt]:
        if not examples:
            return []
        texts = [self.text(ex.prompt) for ex in examples]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        bos = self.tokenizer.bos_token_id
        prefix = [bos] if bos is not None and not self.chat_template else []
        return [Prompt(prefix + list(t), ex.prompt, ex.answer, ex.row)
                for t, ex in zip(ids, examples)]
