"""Shared-prompt micro-batches: each prompt's forward once for all the samples of its group.

The G samples of a group (GRPO, RLOO, ...) begin with the same prompt. A padded micro-batch
computes that prompt G times, identically: on the default recipe's batches the prompt is over
half of every row. Here the rows of a micro-batch that share a prompt become one "tree" row:

    [prompt (p tokens) | suffix_1 | suffix_2 | ... | suffix_m]

where suffix_i is everything of sample i after its prompt (its turns, and for multi-turn
episodes the observations between them). Position ids are those of the padded rows: the
prompt 0..p-1, each suffix p..p+|suffix_i|-1. A [p + sum |suffix_i|]^2 attention mask keeps
each token inside its own sample: a prompt token sees the earlier prompt tokens, a suffix token
the whole prompt and the earlier tokens of its own suffix, never another sample's.

Every token of every sample therefore gets exactly the hidden states of its padded row (the
same positions, attending to the same keys), so the logprobs, values and gradients are those
of the padded micro-batch up to float rounding (tested). The gradient through the prompt's
hidden states is the sum of the G samples' contributions, which is what the padded rows' G
copies of the prompt sum to in the weights' gradient.

What is scored: padded position (b, c) scores token c + 1 of sample b from the hidden state at
token c. For c >= p_b - 1 (the last prompt token and every suffix token but the last) that hidden
state sits at one tree position; the last prompt token's position scores the first suffix token
of all m samples, each with its own target. So the model's per-position outputs are gathered
into S = sum_b (len_b - p_b) scored entries (`SharedPromptRows.gather`, with their `targets`)
before the LM head, and put back into [B, T-1] (`dst_row`, `dst_col`). Positions inside the
prompt (c < p_b - 1) score prompt tokens, never sampled: nothing reads them, and they stay 0.

Which rows share: rows of one micro-batch with the same group id, the same prompt length and
the same prompt tokens (checked; a row whose prompt differs from its group's first row's forms
a tree of its own, so any batch stays exact). Micro-batches are cut group by group
(`rl_step`), so a group of G <= micro_batch_size samples is one tree.

The attention runs with the dense mask: Hugging Face passes a 4-D mask to sdpa/eager as it is
(`model.attn_implementation` sdpa or eager). Its cost is sum over trees of L_tree^2 instead of
sum over rows of len_b^2: worth it where prompts are long next to the samples (short answers,
long system prompts, tools), not for long responses, where the packed micro-batches
(`trainer.max_tokens_per_micro_batch`) are the tool. docs/trainer.md has the measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from llamarl.trainer.device import tensor_to


@dataclass
class SharedPromptRows:
    """A micro-batch's N trees, right-padded to L tokens.

    input_ids, position_ids: [N, L]; attention_mask: [N, 1, L, L] bool, True where a query
    (dim 2) may attend to a key (dim 3); padding positions attend to themselves only.
    gather: [S] int64, the flat index (tree * L + position) of the hidden state that scores
    entry k; targets: [1, S], the token it scores; dst_row, dst_col: [S], where entry k goes in
    the padded [B, T-1] layout. tokens: the trees' real tokens (for the padding share)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    gather: torch.Tensor
    targets: torch.Tensor
    dst_row: torch.Tensor
    dst_col: torch.Tensor
    tokens: int

    def to(self, device: torch.device) -> SharedPromptRows:
        return SharedPromptRows(**{f.name: getattr(self, f.name) if f.name == "tokens"
                                   else tensor_to(getattr(self, f.name), device)
                                   for f in fields(self)})

    def scored(self, x: torch.Tensor) -> torch.Tensor:
        """Per-position outputs of the trees, [N, L, *] -> the scored entries' [1, S, *]."""
        return x.flatten(0, 1)[self.gather][None]


def tree_of_rows(ids: torch.Tensor, lens: torch.Tensor, prompt_lens: torch.Tensor,
                 group_ids: torch.Tensor) -> torch.Tensor:
    """[B] int64: the tree of each row, numbered 0.. in order of first appearance. Rows share
    a tree when they have the same group id and prompt length and their prompt tokens equal
    those of the first such row; any other row is a tree of its own."""
    B, T = ids.shape
    if B == 0:
        return torch.zeros(0, dtype=torch.long)
    p = torch.minimum(prompt_lens.long(), lens.long())
    key = torch.stack([group_ids.long(), p], 1)
    _, first_of_key = torch.unique(key, dim=0, return_inverse=True)
    # the first row of each key: the smallest row index with it
    leader = torch.full((int(first_of_key.max()) + 1,), B, dtype=torch.long)
    leader = leader.scatter_reduce(0, first_of_key, torch.arange(B), reduce="amin")[first_of_key]
    in_prompt = torch.arange(T)[None, :] < p[:, None]
    same = ((ids == ids[leader]) | ~in_prompt).all(1) & (p > 0)
    owner = torch.where(same, leader, torch.arange(B))  # the row whose tree b joins
    # number the trees by the first appearance of their owner
    is_owner = owner == torch.arange(B)
    number = torch.cumsum(is_owner.long(), 0) - 1
    return number[owner]


def share_prompts(ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lens: torch.Tensor,
                  group_ids: torch.Tensor) -> SharedPromptRows:
    """The shared-prompt layout of a padded micro-batch: ids, attention_mask [B, T] (right
    padding), prompt_lens, group_ids [B]. All index arithmetic on tensors, no per-row loop."""
    B, T = ids.shape
    lens = attention_mask.sum(1).long()
    p = torch.minimum(prompt_lens.long(), lens)
    tree = tree_of_rows(ids, lens, p, group_ids)
    N = int(tree.max()) + 1 if B else 0
    is_owner = torch.zeros(B, dtype=torch.bool)
    if B:
        first = torch.full((N,), B, dtype=torch.long).scatter_reduce(
            0, tree, torch.arange(B), reduce="amin")
        is_owner[first] = True
    # each row's suffix [p_b, len_b) follows its tree's prompt and the earlier rows' suffixes
    suffix = lens - p
    before = torch.zeros(B, dtype=torch.long)  # suffix tokens of earlier rows of the tree
    order = torch.argsort(tree, stable=True)
    s_sorted = suffix[order]
    csum = torch.cumsum(s_sorted, 0) - s_sorted
    tree_start = torch.zeros(N, dtype=torch.long).scatter_reduce(
        0, tree[order], csum, reduce="amin", include_self=False)
    before[order] = csum - tree_start[tree[order]]
    tree_p = torch.zeros(N, dtype=torch.long).index_put_((tree,), p)  # one value per tree
    tree_len = tree_p + torch.zeros(N, dtype=torch.long).index_add_(0, tree, suffix)
    offset = tree_p[tree] + before  # tree position of each row's first suffix token
    L = max(int(tree_len.max()), 2) if B else 2

    col = torch.arange(T)[None, :].expand(B, T)
    real = col < lens[:, None]
    in_prompt = col < p[:, None]
    # tree position of padded cell (b, c): c in the prompt, offset_b + c - p_b in the suffix
    pos = torch.where(in_prompt, col, offset[:, None] + col - p[:, None])
    placed = real & (~in_prompt | is_owner[:, None])  # a prompt is placed by its owner only
    rows_t = tree[:, None].expand(B, T)
    input_ids = torch.zeros((N, L), dtype=ids.dtype)
    input_ids[rows_t[placed], pos[placed]] = ids[placed]
    position_ids = torch.zeros((N, L), dtype=torch.long)
    position_ids[rows_t[placed], pos[placed]] = col[placed]
    # segment of each tree position: 0 = prompt, 1 + row = that row's suffix, -1 = padding
    segment = torch.full((N, L), -1, dtype=torch.long)
    segment[rows_t[placed], pos[placed]] = torch.where(
        in_prompt, torch.zeros_like(col), 1 + torch.arange(B)[:, None].expand(B, T))[placed]
    causal = torch.ones((L, L), dtype=torch.bool).tril()
    q, k = segment[:, :, None], segment[:, None, :]
    mask = causal & ((q == k) | ((k == 0) & (q >= 0)))
    # scored entries: padded positions c in [max(p_b - 1, 0), len_b - 2] score token c + 1
    scored = (col >= (p - 1).clamp(min=0)[:, None]) & (col <= (lens - 2)[:, None])
    gather = tree[:, None] * L + pos
    following = torch.cat([ids[:, 1:], ids[:, :1]], 1)  # [B, T]: the token each cell scores
    return SharedPromptRows(
        input_ids=input_ids, position_ids=position_ids, attention_mask=mask[:, None],
        gather=gather[scored], targets=following[scored][None],
        dst_row=torch.arange(B)[:, None].expand(B, T)[scored], dst_col=col[scored],
        tokens=int(tree_len.sum()))
