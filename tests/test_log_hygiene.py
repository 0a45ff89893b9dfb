"""generator/log_hygiene.py: a third-party warning repeated word for word is printed once, and
one that says nothing about a llamarl run not at all."""


def test_a_repeated_vllm_warning_is_printed_once(capsys):
    import logging

    from llamarl.generator.log_hygiene import OncePerMessage

    logger = logging.getLogger("llamarl-test-third-party")
    handler = logging.StreamHandler()
    handler.addFilter(OncePerMessage())
    logger.addHandler(handler)
    try:
        for _ in range(4):
            logger.warning("CPU backend doesn't allow to use `torch.set_num_threads`")
        logger.warning("another")
        logger.warning("vLLM has deprecated support for supporting different tokenizers for "
                       "different LoRAs. By default, vLLM uses base model's tokenizer.")
        try:  # as vllm/tool_parsers/hermes_tool_parser.py logs a model's malformed call
            raise ValueError("Extra data")
        except ValueError:
            logger.exception("Error in extracting tool call from response.")
    finally:
        logger.removeHandler(handler)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["CPU backend doesn't allow to use `torch.set_num_threads`", "another"]
