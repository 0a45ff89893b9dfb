"""Supervised fine-tuning with the Tinker SDK alone, in the shape of tinker-cookbook's `sl_loop`
(chat-rendered conversations, loss on the assistant's tokens only, `cross_entropy`, Adam with a
linearly decaying rate, checkpoints with save_state), against a llamarl service
(docs/service.md). Local data: recipes/data/add2_{train,eval}.jsonl, each row's `answer` as
the assistant's reply (rows with `messages` are used as they are).

    python -m llamarl.service recipes/serve_smollm2_cpu.yaml service.port=8000 &
    python examples/tinker_sl_loop.py --base-url http://127.0.0.1:8000 --steps 20

Each step: a batch of --batch conversations, one forward_backward and one optim_step submitted
together (the SDK queues them in order; the server runs them one after the other), the loss
per trained token (`loss:sum` over the weights' sum). Every --eval-every steps (and at the
end): the held-out loss per token, from `forward` (no gradient). Every --save-every steps:
save_state (a path `--resume` takes, with the optimizer's state). At the end: the adapter
saved for sampling and one greedy answer sampled from it. One JSON line per step on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import tinker
from tinker import types


def conversation(row: dict) -> list[dict]:
    if "messages" in row:
        return row["messages"]
    return [{"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["answer"]}]


def datum(tok, messages: list[dict]) -> tuple[types.Datum, int]:
    """The conversation rendered by the model's chat template; weight 1 on the tokens of its
    last (assistant) turn, 0 on the rest. -> (the datum, its trained tokens)."""
    prefix = tok.apply_chat_template(messages[:-1], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    full = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert full[:len(prefix)] == prefix, "the chat template re-renders earlier turns"
    weights = [0.0] * (len(prefix) - 1) + [1.0] * (len(full) - len(prefix))
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": full[1:], "weights": weights}), \
        len(full) - len(prefix)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--base-model", default="smollm2:135m-instruct")
    ap.add_argument("--train", default="recipes/data/add2_train.jsonl")
    ap.add_argument("--eval", default="recipes/data/add2_eval.jsonl")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-rows", type=int, default=64)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--resume", default="", help="a save_state path to continue from")
    args = ap.parse_args()

    train = [json.loads(line) for line in open(args.train)]
    held_out = [json.loads(line) for line in open(args.eval)][:args.eval_rows]
    random.Random(args.seed).shuffle(train)
    sc = tinker.ServiceClient(base_url=args.base_url, api_key="tml-local")
    if args.resume:
        tc = sc.create_training_client_from_state_with_optimizer(args.resume).result()
    else:
        tc = sc.create_lora_training_client(base_model=args.base_model, rank=args.rank,
                                            seed=args.seed, train_unembed=False).result()
    tok = tc.get_tokenizer()
    evals = [datum(tok, conversation(r)) for r in held_out]
    start = time.time()
    for step in range(args.steps):
        rows = [train[(step * args.batch + i) % len(train)] for i in range(args.batch)]
        batch = [datum(tok, conversation(r)) for r in rows]
        lr = args.lr * (1 - step / args.steps)  # linear decay to 0, as the cookbook's
        fb = tc.forward_backward([d for d, _ in batch], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=lr))
        row = {"step": step, "lr": lr,
               "train_loss": fb.result().metrics["loss:sum"] / sum(n for _, n in batch)}
        opt.result()
        last = step == args.steps - 1
        if args.eval_every and (step % args.eval_every == 0 or last):
            out = tc.forward([d for d, _ in evals], "cross_entropy").result()
            row["held_out_loss"] = out.metrics["loss:sum"] / sum(n for _, n in evals)
        if args.save_every and ((step + 1) % args.save_every == 0 or last):
            row["state"] = tc.save_state(f"step-{step + 1}").result().path
        row["time_s"] = round(time.time() - start, 1)
        print(json.dumps(row), flush=True)
    sampler = tc.save_weights_and_get_sampling_client().result()
    question = conversation(held_out[0])[:-1]
    prompt = tok.apply_chat_template(question, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    answer = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                            sampling_params=types.SamplingParams(
                                max_tokens=16, temperature=1e-4, seed=args.seed)).result()
    print(json.dumps({"question": question[-1]["content"],
                      "answer": tok.decode(answer.sequences[0].tokens,
                                           skip_special_tokens=True)}), flush=True)


if __name__ == "__main__":
    main()
