"""The SDK compatibility table of docs/service.md, generated from the installed `tinker` SDK by
introspection: every public method of its four clients (`x` and `x_async` one row), with what
this server does for it. A method the SDK gains that is not classified here fails the test
that keeps the page current (tests/test_service_compat.py), so the table never silently
misses one.

    python -m llamarl.service.compat          # print the table
    python -m llamarl.service.compat --write  # rewrite it in docs/service.md

Statuses: `yes` (served; each driven through the SDK in tests/test_service_api.py or
tests/test_service_compat.py), `local` (the
SDK answers it without a request of its own, or from what this server already sent),
`no` (a 404 or 400 with the reason; the SDK raises at once).
"""

from __future__ import annotations

import inspect
import sys
from collections import Counter
from pathlib import Path

CLIENTS = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")
PLATFORM = "the hosted platform's account feature (projects, billing, publishing, audit)"

# (client, method) -> (status, what this server does)
SUPPORT: dict[tuple[str, str], tuple[str, str]] = {
    ("ServiceClient", "close"): ("yes", "ends the session: its training clients are freed"),
    ("ServiceClient", "copy_weights"): ("no", "copies into another project: " + PLATFORM),
    ("ServiceClient", "create_custom_loss"): ("local", "the SDK traces the loss itself; "
                                              "forward_backward_custom runs it"),
    ("ServiceClient", "create_lora_training_client"): (
        "yes", "rank, seed, train_mlp / train_attn / train_unembed; up to "
        "service.max_tenants at once"),
    ("ServiceClient", "create_rest_client"): ("local", "a RestClient on this server"),
    ("ServiceClient", "create_sampling_client"): ("yes", "the base, or a saved sampler path"),
    ("ServiceClient", "create_training_client_from_state"): ("yes", "DCP, weights only"),
    ("ServiceClient", "create_training_client_from_state_with_optimizer"): (
        "yes", "DCP, with AdamW's moments"),
    ("ServiceClient", "get_console_url"): ("local", "a URL of the hosted console (none here)"),
    ("ServiceClient", "get_server_capabilities"): ("yes", "the one base model"),
    ("ServiceClient", "get_telemetry"): ("local", "the SDK's telemetry (the server drops it)"),
    ("ServiceClient", "holder"): ("local", "the SDK's connection"),
    ("TrainingClient", "create_sampling_client"): ("yes", "a saved sampler path"),
    ("TrainingClient", "forward"): ("yes", "logprobs and loss, no gradient"),
    ("TrainingClient", "forward_backward"): (
        "yes", "cross_entropy, importance_sampling, ppo, cispo, dro, gspo (Tinker's per-token "
        "sums); gradients accumulate until optim_step"),
    ("TrainingClient", "forward_backward_custom"): ("yes", "a forward, the loss in the SDK, "
                                                    "then a weighted cross_entropy"),
    ("TrainingClient", "get_console_url"): ("local", "a URL of the hosted console (none here)"),
    ("TrainingClient", "get_info"): ("local", "what create_model's get_info answered"),
    ("TrainingClient", "get_telemetry"): ("local", "the SDK's telemetry"),
    ("TrainingClient", "get_tokenizer"): ("local", "loads the model's local directory "
                                          "(offline)"),
    ("TrainingClient", "load_state"): ("yes", "DCP, weights only"),
    ("TrainingClient", "load_state_with_optimizer"): ("yes", "DCP, with AdamW's moments"),
    ("TrainingClient", "optim_step"): ("yes", "AdamW (decoupled decay), grad_clip_norm"),
    ("TrainingClient", "save_state"): ("yes", "DCP under service.dir"),
    ("TrainingClient", "save_weights_and_get_sampling_client"): (
        "yes", "needs service.sampling (the adapter as PEFT files)"),
    ("TrainingClient", "save_weights_external"): (
        "no", "exports to the hosted bucket; here a sampler save is already PEFT's files on "
        "disk"),
    ("TrainingClient", "save_weights_for_sampler"): ("yes", "PEFT's adapter files"),
    ("SamplingClient", "compute_logprobs"): ("yes", "prompt logprobs (not "
                                             "prompt_logprobs_last_n)"),
    ("SamplingClient", "create"): ("yes", "what create_sampling_client calls"),
    ("SamplingClient", "from_sampler_handle"): ("local", "rebuilds a client in another "
                                                "process"),
    ("SamplingClient", "get_base_model"): ("local", "the base model's name"),
    ("SamplingClient", "get_sampler_handle"): ("local", "a handle to pass to another process"),
    ("SamplingClient", "get_telemetry"): ("local", "the SDK's telemetry"),
    ("SamplingClient", "get_tokenizer"): ("local", "loads model.path locally"),
    ("SamplingClient", "on_queue_state_change"): ("local", "a callback on queue states"),
    ("SamplingClient", "sample"): (
        "yes", "num_samples, temperature, top_p, top_k, max_tokens, stop, seed, logprobs, "
        "prompt logprobs (no top-k alternatives)"),
    ("RestClient", "assign_session_project"): ("no", PLATFORM),
    ("RestClient", "copy_weights"): ("no", PLATFORM),
    ("RestClient", "delete_checkpoint"): ("yes", "removes the checkpoint's directory"),
    ("RestClient", "delete_checkpoint_from_tinker_path"): ("yes", "the same, by path"),
    ("RestClient", "export_session_trace"): ("no", "the hosted trace store"),
    ("RestClient", "get_audit_log"): ("no", PLATFORM),
    ("RestClient", "get_billing_usage"): ("no", PLATFORM),
    ("RestClient", "get_current_checkpoint_storage_usage"): ("no", PLATFORM),
    ("RestClient", "get_external_weights_urls"): ("no", "the hosted bucket "
                                                  "(save_weights_external)"),
    ("RestClient", "get_sampler"): ("yes", "base model and adapter path"),
    ("RestClient", "get_server_capabilities"): ("yes", "the one base model"),
    ("RestClient", "get_session"): ("yes", "its training runs and samplers"),
    ("RestClient", "get_telemetry"): ("local", "the SDK's telemetry"),
    ("RestClient", "get_training_run"): ("yes", "live, or from its checkpoints on disk"),
    ("RestClient", "get_training_run_by_tinker_path"): ("yes", "the same, by path"),
    ("RestClient", "get_weights_info_by_tinker_path"): ("yes", "base model, LoRA rank"),
    ("RestClient", "list_checkpoints"): ("yes", "a run's, from service.dir"),
    ("RestClient", "list_sessions"): ("yes", "the sessions alive now"),
    ("RestClient", "list_training_runs"): ("yes", "live and saved, the newest first"),
    ("RestClient", "list_user_checkpoints"): ("yes", "every run's, the newest first"),
    ("RestClient", "publish_checkpoint_from_tinker_path"): ("no", PLATFORM),
    ("RestClient", "search_sessions"): ("no", PLATFORM),
    ("RestClient", "set_checkpoint_ttl_from_tinker_path"): ("no", PLATFORM),
    ("RestClient", "unpublish_checkpoint_from_tinker_path"): ("no", PLATFORM),
    ("RestClient", "whoami"): ("no", "needs the hosted service's JWT login (this server takes "
                               "any `tml-` key)"),
}
BEGIN, END = "<!-- compat table: begin -->", "<!-- compat table: end -->"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "service.md"


def sdk_methods() -> dict[str, list[str]]:
    """{client: its public methods, `_async` twins folded in}, from the installed SDK."""
    import tinker

    out = {}
    for client in CLIENTS:
        names = {n.removesuffix("_async") for n, _ in inspect.getmembers(getattr(tinker, client))
                 if not n.startswith("_")}
        out[client] = sorted(names)
    return out


def table() -> str:
    """The markdown table; a ValueError naming each SDK method not classified in SUPPORT."""
    import tinker

    methods = sdk_methods()
    missing = [f"{c}.{m}" for c, ms in methods.items() for m in ms if (c, m) not in SUPPORT]
    if missing:
        raise ValueError(f"tinker {tinker.__version__} has methods llamarl/service/compat.py "
                         f"does not classify: {', '.join(missing)}: add each to SUPPORT")
    counts = Counter(SUPPORT[(c, m)][0] for c, ms in methods.items() for m in ms)
    lines = [f"Generated from `tinker` {tinker.__version__} by `python -m llamarl.service.compat "
             "--write`: ", "", "| client | method | here | |", "|---|---|---|---|"]
    for client, names in methods.items():
        for name in names:
            status, why = SUPPORT[(client, name)]
            lines.append(f"| {client} | `{name}` | {status} | {why} |")
    total = sum(len(ms) for ms in methods.values())
    lines[0] += (f"{total} methods: {counts['yes']} served, {counts['local']} answered by the "
                 f"SDK itself, {counts['no']} not served.")
    return "\n".join(lines)


def page_text(page: str) -> str:
    """`page` with the text between its markers replaced by the table."""
    head, sep, rest = page.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise ValueError(f"{PAGE} lacks the markers {BEGIN} ... {END}")
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        PAGE.write_text(page_text(PAGE.read_text()))
        print(f"wrote the table into {PAGE}")
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
