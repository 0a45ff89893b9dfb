"""Rule-based verifiers: GSM8K `#### n` answers, a final number, `\\boxed{...}` answers, and a
format check.

Each verifier is `fn(completion, answer, prompt) -> float` in {0, 1}.

* `gsm8k`: the number after the last `####` in the completion equals the reference number. The
  reference may be a whole GSM8K solution (ending `#### 72`) or a bare number. Numbers are
  compared as numbers: `1,000` == `1000`, `$18` == `18`, `72.` == `72.0` == `72`.
* `boxed`: the content of the last `\\boxed{...}` (nested braces allowed) equals the reference
  (itself boxed, a GSM8K solution, or bare). Both sides are normalised (spaces, `\\left`,
  `\\dfrac`, `\\text{}`, `$` ...); if both then read as numbers (including `a/b` and
  `\\frac{a}{b}` with numeric parts) they are compared numerically, else as strings.
* `numeric`: the completion's final answer equals the reference number: the content of the
  last `<answer>...</answer>` tag when there is one, else the last number in the completion
  (`85`, `-3`, `1,000`, `12.0`, `$18`; `12.0` == `12`). The reference: a bare number or a GSM8K
  solution.
* `format`: 1 when `re.search(pattern, completion)` matches (pattern: `reward.format_pattern`;
  the default asks for a final line `#### <number>`).
"""

from __future__ import annotations

import math
import re

# One number as written in GSM8K answers: optional sign and dollar, digits with optional
# thousands commas, optional decimals, e.g. -5, $1,000, 3.25, .5
_NUMBER = r"-?\$?-?(?:\d[\d,]*(?:\.\d*)?|\.\d+)"
_AFTER_HASHES = re.compile(r"\s*(" + _NUMBER + r")")
_FRACTION = re.compile(r"^\\frac\{([^{}]+)\}\{([^{}]+)\}$|^([^/]+)/([^/]+)$")


def parse_number(text: str) -> float | None:
    """`text` as a finite number, or None. Accepts `1,000`, `$18`, `72.`, `-3.5`, `50%` is not
    a number (None)."""
    s = text.strip().replace(",", "").replace("\\$", "").replace("$", "").rstrip(".")
    if not re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", s):  # no inf/nan/1e5/1_000
        return None
    value = float(s)
    return value if math.isfinite(value) else None


def numbers_equal(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def gsm8k_number(text: str) -> float | None:
    """The number right after the last `####` in `text` (None if there is none)."""
    at = text.rfind("####")
    if at < 0:
        return None
    m = _AFTER_HASHES.match(text, at + 4)
    return parse_number(m.group(1)) if m else None


def reference_number(answer: str) -> float:
    """The reference of a GSM8K-style answer: a solution ending `#### n` or a bare number."""
    value = gsm8k_number(answer) if "####" in answer else parse_number(answer)
    if value is None:
        raise ValueError(f"the reference answer {answer[-60:]!r} has no number (expected a "
                         "GSM8K solution ending '#### <n>' or a bare number)")
    return value


def gsm8k(completion: str, answer: str, prompt: str) -> float:
    got = gsm8k_number(completion)
    return float(got is not None and numbers_equal(got, reference_number(answer)))


# A number in running text: a minus sign not glued to a word or a closing bracket (`5-3` is
# 5 and 3; `x = -3` is -3), an optional dollar, digits grouped by thousands commas or plain,
# optional decimals. A comma not followed by exactly three digits ends the number (`1, 2`).
_NUMBER_IN_TEXT = re.compile(
    r"(?:(?<![\w)\]])-)?\$?(?<![\d.])(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def final_number(text: str) -> float | None:
    """The final answer of `text` as a number: the last `<answer>...</answer>`'s content
    (None if it is not a number), else the last number in the text (None if there is none)."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return parse_number(tags[-1])
    found = _NUMBER_IN_TEXT.findall(text)
    return parse_number(found[-1]) if found else None


def numeric(completion: str, answer: str, prompt: str) -> float:
    got = final_number(completion)
    return float(got is not None and numbers_equal(got, reference_number(answer)))


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, braces balanced; None if absent or
    unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def normalise_math(text: str) -> str:
    """A canonical spelling for comparing final answers as strings."""
    s = text.strip().strip("$")
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""),
                     ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\$", ""), ("^\\circ", ""),
                     ("^{\\circ}", "")):
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


def math_value(text: str) -> float | None:
    """A normalised answer as a number: plain, or a fraction `a/b` / `\\frac{a}{b}`."""
    value = parse_number(text)
    if value is not None:
        return value
    m = _FRACTION.match(text)
    if not m:
        return None
    num, den = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
    a, b = parse_number(num), parse_number(den)
    if a is None or b is None or b == 0:
        return None
    return a / b


def boxed(completion: str, answer: str, prompt: str) -> float:
    got = last_boxed(completion)
    if got is None:
        return 0.0
    if "\\boxed{" in answer:
        ref = last_boxed(answer)
        if ref is None:
            raise ValueError(f"the reference answer {answer[-60:]!r} has an unclosed \\boxed{{")
    elif "####" in answer:
        ref = answer[answer.rfind("####") + 4:]
    else:
        ref = answer
    got, ref = normalise_math(got), normalise_math(ref)
    a, b = math_value(got), math_value(ref)
    if a is not None and b is not None:
        return float(numbers_equal(a, b))
    return float(got == ref)


class FormatReward:
    """1 when the completion matches `pattern` (re.search), else 0."""

    def __init__(self, pattern: str):
        self.pattern = re.compile(pattern)

    def __call__(self, completion: str, answer: str, prompt: str) -> float:
        return float(self.pattern.search(completion) is not None)
