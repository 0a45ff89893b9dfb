"""An episode's context tokens: the prompt, and what follows a turn (an observation, or the
template's continuation of the conversation) as token ids. Used by the environment runner
(multi_turn.py) and by the agent's token-exact capture (capture.py)."""

from __future__ import annotations


class ContextEncoder:
    """Prompt and observation tokens: raw text, or chat messages through the template.

    A list of messages after a turn is rendered as the template's continuation of the
    conversation: its tokens after the assistant's end-of-turn token through the next
    generation prompt ("glue", masked out with the observation)."""

    _SENTINEL = "\u2063llamarl-turn\u2063"

    def __init__(self, tokenizer, formatter):
        self.tokenizer = tokenizer
        self.formatter = formatter

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            from llamarl.tiny.task import Example
            return self.formatter.encode([Example(prompt, "")])[0].token_ids
        text = self.tokenizer.apply_chat_template(prompt, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def observation_ids(self, observation, turn_ended_with_eos: bool) -> list[int]:
        if isinstance(observation, str):
            return self.tokenizer(observation, add_special_tokens=False)["input_ids"]
        return self.tokenizer(self.glue_text(observation, turn_ended_with_eos),
                              add_special_tokens=False)["input_ids"]

    def glue_text(self, messages: list[dict], turn_ended_with_eos: bool) -> str:
        tok = self.tokenizer
        base = [{"role": "user", "content": "u"},
                {"role": "assistant", "content": self._SENTINEL}]
        text = tok.apply_chat_template(base + list(messages), tokenize=False,
                                       add_generation_prompt=True)
        at = text.find(self._SENTINEL)
        if at < 0:
            raise ValueError("the chat template does not render assistant messages' content: "
                             "multi-turn observations need a template that does")
        glue = text[at + len(self._SENTINEL):]
        eos = tok.eos_token or ""
        if turn_ended_with_eos and eos and glue.startswith(eos):
            glue = glue[len(eos):]  # the sampled turn already holds it
        return glue
