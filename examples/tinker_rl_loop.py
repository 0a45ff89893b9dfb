"""RL on 2-digit addition with the Tinker SDK alone, in the shape of tinker-cookbook's
`rl_loop` (GRPO-style group advantages, the `importance_sampling` loss), against a llamarl
service (docs/service.md). Local data: recipes/data/add2_{train,eval}.jsonl (the task of
recipes/smollm2_add_cpu.yaml).

    python -m llamarl.service recipes/serve_smollm2_cpu.yaml service.port=8000 &
    python examples/tinker_rl_loop.py --base-url http://127.0.0.1:8000 --steps 30

Each step: save the adapter for sampling, sample `--group` completions for each of `--prompts`
prompts, reward 1 when the last number of a completion is the answer, advantage = reward -
the group's mean (groups whose rewards are all equal carry no signal and are skipped), one
forward_backward with importance_sampling on the sampler's logprobs, one optim_step. Every
`--eval-every` steps (and at the end): the mean reward over the held-out prompts. One JSON
line per step on stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import tinker
from tinker import types

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def reward(text: str, answer: str) -> float:
    found = NUMBER.findall(text.replace(",", ""))
    return float(bool(found) and float(found[-1]) == float(answer))


def prompt_tokens(tok, question: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": question}],
                                   add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def evaluate(sampler, tok, rows, samples: int, max_tokens: int, seed: int) -> float:
    futures = [sampler.sample(types.ModelInput.from_ints(prompt_tokens(tok, r["prompt"])),
                              num_samples=samples,
                              sampling_params=types.SamplingParams(
                                  max_tokens=max_tokens, temperature=1.0, seed=seed + i))
               for i, r in enumerate(rows)]
    scores = [reward(tok.decode(s.tokens, skip_special_tokens=True), r["answer"])
              for r, f in zip(rows, futures) for s in f.result().sequences]
    return sum(scores) / len(scores)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--base-model", default="smollm2:135m-instruct")
    ap.add_argument("--train", default="recipes/data/add2_train.jsonl")
    ap.add_argument("--eval", default="recipes/data/add2_eval.jsonl")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-samples", type=int, default=2)
    ap.add_argument("--eval-rows", type=int, default=128, help="held-out prompts evaluated")
    args = ap.parse_args()

    train = [json.loads(line) for line in open(args.train)]
    held_out = [json.loads(line) for line in open(args.eval)][:args.eval_rows]
    sc = tinker.ServiceClient(base_url=args.base_url, api_key="tml-local")
    tc = sc.create_lora_training_client(base_model=args.base_model, rank=args.rank,
                                        seed=args.seed, train_unembed=False).result()
    tok = tc.get_tokenizer()
    order = list(range(len(train)))
    __import__("random").Random(args.seed).shuffle(order)
    start = time.time()
    for step in range(args.steps + 1):
        sampler = tc.save_weights_and_get_sampling_client().result()
        row = {"step": step, "time_s": round(time.time() - start, 1)}
        if step % args.eval_every == 0 or step == args.steps:
            row["held_out"] = evaluate(sampler, tok, held_out, args.eval_samples,
                                       args.max_tokens, 10_000 * args.seed)
        if step == args.steps:
            print(json.dumps(row), flush=True)
            break
        t_sample = time.time()
        batch = [train[order[(step * args.prompts + i) % len(order)]]
                 for i in range(args.prompts)]
        prompts = [prompt_tokens(tok, r["prompt"]) for r in batch]
        futures = [sampler.sample(types.ModelInput.from_ints(p), num_samples=args.group,
                                  sampling_params=types.SamplingParams(
                                      max_tokens=args.max_tokens, temperature=1.0,
                                      seed=args.seed * 1_000_000 + step * 1000 + i))
                   for i, p in enumerate(prompts)]
        data, rewards = [], []
        for r, p, f in zip(batch, prompts, futures):
            seqs = f.result().sequences
            scores = [reward(tok.decode(s.tokens, skip_special_tokens=True), r["answer"])
                      for s in seqs]
            rewards += scores
            mean = sum(scores) / len(scores)
            if all(x == scores[0] for x in scores):
                continue  # no signal in this group
            for s, x in zip(seqs, scores):
                tokens = p + list(s.tokens)
                n = len(s.tokens)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * (len(p) - 1) + list(s.logprobs),
                        "advantages": [0.0] * (len(p) - 1) + [x - mean] * n}))
        row["reward"] = sum(rewards) / len(rewards)
        row["datums"] = len(data)
        t_train = time.time()
        row["sample_s"] = round(t_train - t_sample, 2)
        if data:
            fb = tc.forward_backward(data, "importance_sampling")
            opt = tc.optim_step(types.AdamParams(learning_rate=args.lr))
            row["loss_sum"] = fb.result().metrics["loss:sum"]
            opt.result()
            row["train_s"] = round(time.time() - t_train, 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
