"""A real vLLM engine (tiny model) loading new weights while sequences run (continuous mode).

    python tests/dist/engine_in_flight.py MODEL_DIR IN_FLIGHT_KV

32 samples (8 prompts x 4) of up to 60 tokens are submitted under weights A (version 0), and 4
more of prompt 0, two of which are aborted after 4 engine steps (Engine.abort); after 8 engine
steps weights B (A plus noise) are loaded between two steps (Engine.swap_weights) and
the samples run to the end. Each completion says which version sampled which tokens; the
tokens are then scored by Hugging Face copies of A and B over the whole sequence, as the trainer
does. Prints one JSON line: the versions seen, and per version the largest |engine logprob -
recomputed logprob| over the tokens that version sampled.
"""

import json
import sys


def main(model_dir: str, in_flight_kv: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from llamarl.config import GeneratorConfig
    from llamarl.generator.engine import Engine

    cfg = GeneratorConfig(max_model_len=128, prompts_per_step=8, samples_per_prompt=4,
                          max_new_tokens=60, mode="continuous", in_flight_kv=in_flight_kv)
    engine = Engine(model_dir, cfg, "float32", seed=0, on_cpu=True)
    models = [AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
              for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in models[1].parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.std())
    state_b = {k: v.clone() for k, v in models[1].state_dict().items()}

    prompts = [[1] + [4 + (i * 5 + j * 3) % 26 for j in range(11)] for i in range(8)]
    engine.begin(7)
    for i, p in enumerate(prompts):
        for j in range(4 if i else 8):  # 4 more of prompt 0, two of them aborted
            engine.submit(f"{i}/{j}", p, 1.0, 60)
    done = []
    for _ in range(4):
        done += engine.step()
    running, at_abort = engine.running, len(done)
    alive = sum(1 for r in ("0/4", "0/5") if r not in {x for x, _ in done})
    engine.abort(["0/4", "0/5", "no/such"])  # (a slot handed back: its groups stop)
    aborted = running - engine.running
    for _ in range(4):
        done += engine.step()
    running_at_load = engine.running
    model = engine.worker.model_runner.model
    engine.swap_weights(lambda: model.load_weights(iter(state_b.items())), version=1)
    while engine.busy:
        done += engine.step()

    worst = {0: 0.0, 1: 0.0}
    spans_seen = set()
    for request_id, c in done:
        prompt = prompts[int(request_id.split("/")[0])]
        ids = torch.tensor([prompt + c.token_ids])
        at = 0
        for n, v in c.versions:
            spans_seen.add(v)
            with torch.no_grad():
                logits = models[v](input_ids=ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            ours = lp[len(prompt) - 1 + at:len(prompt) - 1 + at + n]
            d = (ours - torch.tensor(c.logprobs[at:at + n])).abs().max().item() if n else 0.0
            worst[v] = max(worst[v], d)
            at += n
        assert at == len(c.token_ids) == len(c.logprobs)
    print(json.dumps({
        "finished": len(done) - (2 - alive), "running_at_load": running_at_load,
        "aborted": aborted, "alive_at_abort": alive,
        "finished_after_abort": sum(1 for r, _ in done[at_abort:] if r in ("0/4", "0/5")),
        "spanning": sum(1 for _, c in done if len(c.versions) > 1),
        "versions": sorted(spans_seen), "max_abs_diff": worst,
        "recomputed_tokens": engine.recomputed_tokens,
    }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
