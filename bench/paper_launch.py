"""A launch on paper: the recipe, the rank layout and the communication plan the launcher builds
(llamarl.config.load_config, runtime/layout.py: compute_layout, parallel/plan.py: comm_plan)
for cluster-sized layouts, without starting a process; what each rank would join, counted.

For each (trainer ranks T, engines E, tp) it reports the smallest generator.prompts_per_step
the recipe accepts, and the process groups a trainer rank, an engine's leader and another tp
rank of an engine join (every group built on the job store: weights, resharding, rollout
channels across nodes, an engine's command stream), on NCCL (GPUs: each group but the rollout
pairs, which are gloo, is an NCCL communicator of its own on that GPU) with
sync.weight_groups auto and shared. Rollout channels between ranks of one node go through shared
memory and count nothing here. tests/test_paper_launch.py asserts the budgets on the same counts.

    python bench/paper_launch.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import bench_parser, write_result  # noqa: E402

LAYOUTS = [(8, 8, 1), (32, 32, 1), (256, 768, 1), (256, 96, 8)]
RANKS_PER_NODE = 8
RECIPE = ROOT / "recipes" / "qwen2.5_7b_ppo_gsm8k_2x8gpu.yaml"
# the recipe's GSM8K files are the user's to download: a local file of the same fields stands
# in (the data is not what is counted)
DATA = [f"data.path={ROOT / 'recipes/data/add2_train.jsonl'}",
        f"data.eval_path={ROOT / 'recipes/data/add2_eval.jsonl'}", "data.eval_prompts=16",
        "data.prompt_field=prompt", "data.answer_field=answer"]


def smallest_prompts(T: int, E: int) -> int:
    """The smallest prompts_per_step load_config accepts for T trainer ranks and E engines,
    looked for among the multiples of T and E up to E x T (the old rule's bound)."""
    from llamarl.config import load_config

    base = [*DATA, "trainer.ranks=" + str(T), "generator.engines=" + str(E)]
    for p in sorted({k * T for k in range(1, E + 1)} | {k * E for k in range(1, T + 1)}):
        try:
            load_config(RECIPE, [*base, f"generator.prompts_per_step={p}"])
            return p
        except ValueError as e:
            if "prompts_per_step" not in str(e):
                raise
    raise AssertionError(f"no prompts_per_step up to {E * T} is accepted")


def count(T: int, E: int, tp: int, weight_groups: str, prompts: int | None = None) -> dict:
    """What each GPU of the launch joins, from the launcher's own config, layout and plan:
    every group (`groups_of`) and the NCCL communicators on its GPU (`gpu_communicators`:
    all but the rollout pairs, which are gloo), for a trainer rank, an engine's leader and
    another tp rank of an engine; and the whole job's communicators."""
    from llamarl.config import load_config
    from llamarl.parallel.plan import comm_plan
    from llamarl.runtime.layout import compute_layout

    prompts = prompts or smallest_prompts(T, E)
    cfg = load_config(RECIPE, [*DATA, f"trainer.ranks={T}", f"generator.engines={E}",
                               f"generator.tp={tp}", f"generator.prompts_per_step={prompts}",
                               f"sync.weight_groups={weight_groups}"])
    world = T + E * tp
    layout = compute_layout(world, RANKS_PER_NODE, T, E, tp)
    plan = comm_plan(cfg, layout, "nccl")
    leader = layout.engine_global_ranks(E - 1)[0]  # (the last engine: on a node of engines)
    other = layout.engine_global_ranks(E - 1)[-1]

    def groups(rank: int) -> dict:
        found = plan.groups_of(rank)
        return {"total": len(found), "nccl": len(plan.gpu_communicators(rank)),
                **{p: sum(g.purpose == p for g in found)
                   for p in ("weights", "reshard", "rollouts", "commands")}}

    # the job's communicators: each group once (its members all count it)
    names = {g.name for r in range(world) for g in plan.gpu_communicators(r)}
    engine_ranks = [r for e in range(E) for r in layout.engine_global_ranks(e)]
    return {"trainer_ranks": T, "engines": E, "tp": tp, "world": world, "nodes": layout.nodes,
            "weight_groups": weight_groups, "pairs": plan.weight_pairs,
            "smallest_prompts_per_step": prompts,
            "trainer_rank_0_groups": groups(layout.trainer_global_ranks[0]),
            "trainer_rank_groups": groups(layout.trainer_global_ranks[-1]),
            "engine_leader_groups": groups(leader),
            "engine_tp_rank_groups": groups(other) if tp > 1 else None,
            "most_nccl_on_an_engine_gpu": max(len(plan.gpu_communicators(r))
                                              for r in engine_ranks),
            "most_nccl_on_a_trainer_gpu": max(len(plan.gpu_communicators(r))
                                              for r in layout.trainer_global_ranks),
            "job_nccl_communicators": len(names),
            "survives_engine_loss": plan.survives_engine_loss}


def main() -> None:
    ap = bench_parser("paper_launch", __doc__)
    args = ap.parse_args()
    rows = []
    for T, E, tp in LAYOUTS:
        for weight_groups in ("auto", "shared"):
            row = count(T, E, tp, weight_groups)
            print(f"T={T:4d} E={E:4d} tp={tp} {weight_groups:6s}: prompts_per_step >= "
                  f"{row['smallest_prompts_per_step']:6d}; NCCL communicators per GPU: "
                  f"trainer <= {row['most_nccl_on_a_trainer_gpu']:4d}, engine <= "
                  f"{row['most_nccl_on_an_engine_gpu']:3d}; job {row['job_nccl_communicators']}",
                  flush=True)
            rows.append(row)
    write_result("paper_launch", {"rows": rows}, args)


if __name__ == "__main__":
    main()
