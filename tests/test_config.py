import re
from pathlib import Path

import pytest
import torch

from llamarl.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("**/*.yaml"))


def test_defaults_validate():
    cfg = load_config(None, [])
    assert isinstance(cfg, Config) and cfg.trainer.ranks == 2


def stand_ins(recipe: Path, tmp_path: Path) -> list[str]:
    """GPU recipes name datasets that live on the cluster (prepared as their header says):
    validate them against empty stand-ins of the same name and format; every other key is
    validated as written."""
    from omegaconf import OmegaConf

    raw = OmegaConf.load(recipe)
    out = []
    for key in ("path", "eval_path"):
        value = OmegaConf.select(raw, f"data.{key}")
        if value and not (ROOT / value).exists():
            stand_in = tmp_path / key / Path(value).name
            stand_in.parent.mkdir(parents=True, exist_ok=True)
            stand_in.touch()
            out.append(f"data.{key}={stand_in}")
    return out


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_recipe_loads_and_opens_with_its_launch_command(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name paths relative to the repository root
    cfg = load_config(recipe, stand_ins(recipe, tmp_path))
    assert cfg.run.steps > 0
    head = recipe.read_text().splitlines()[:6]
    assert head[0].startswith("#"), "a recipe opens with a comment saying what it trains"
    launch = [line for line in head if "torchrun" in line]
    served = [line for line in head if f"python -m llamarl.service recipes/{recipe.name}" in line]
    assert launch or served or any("srun" in line or "sbatch" in line for line in head)
    for line in launch:  # the command starts exactly the ranks the layout needs
        nproc = int(re.search(r"--nproc-per-node[ =](\d+)", line).group(1))
        nodes = re.search(r"--nnodes[ =](\d+)", line)
        world = nproc * (int(nodes.group(1)) if nodes else 1)
        assert world == cfg.trainer.ranks + cfg.generator.engines * cfg.generator.tp, line
        assert f"recipes/{recipe.name}" in line


SBATCH = sorted((ROOT / "recipes" / "slurm").glob("*.sbatch"))


@pytest.mark.parametrize("script", SBATCH, ids=[s.name for s in SBATCH])
def test_every_sbatch_file_starts_the_ranks_its_recipe_needs(script, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    text = script.read_text()
    recipe = ROOT / re.search(r"srun python -m llamarl.launch (\S+)", text).group(1)
    cfg = load_config(recipe, stand_ins(recipe, tmp_path))
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", text).group(1))
    per_node = int(re.search(r"#SBATCH --ntasks-per-node=(\d+)", text).group(1))
    assert nodes * per_node == cfg.trainer.ranks + cfg.generator.engines * cfg.generator.tp
    gpus = re.search(r"#SBATCH --gpus-per-node=(\d+)", text)
    assert (gpus is not None) == (cfg.model.path != "tiny:reverse" and "cpu" not in script.name)


def test_recipes_exist():
    assert RECIPES, "recipes/ must hold at least one recipe"


def test_cli_overrides_beat_yaml(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run:\n  steps: 7\ntrainer:\n  lr: 0.5\n")
    cfg = load_config(recipe, ["run.steps=3"])
    assert cfg.run.steps == 3 and cfg.trainer.lr == 0.5


@pytest.mark.parametrize("override, words", [
    (["trainer.rank=3"], ["trainer.rank", "unknown"]),
    (["nosuch.key=1"], ["nosuch", "unknown"]),
    (["run.steps=abc"], ["run.steps"]),
    (["run.steps=0"], ["run.steps", "> 0"]),
    (["trainer.lr_schedule=linear"], ["trainer.lr_schedule", "constant, cosine"]),
    (["generator.prompts_per_step=5"], ["prompts_per_step", "multiple"]),
    (["generator.samples_per_prompt=1"], ["samples_per_prompt"]),
    (["sync.every=3", "sync.max_staleness=1"], ["max_staleness", ">= 2"]),
    (["algorithm.correction=vtrace"], ["algorithm.correction", "aipo"]),
    (["generator.tp=0"], ["generator.tp", "> 0"]),
    (["sync.solo_mb=0"], ["sync.solo_mb", "> 0"]),
    (["sync.receive_buffers=65"], ["sync.receive_buffers", "between 0 and 64"]),
    (["sync.receive_buffers=-1"], ["sync.receive_buffers", "0 keeps a buffer per bucket"]),
    (["sync.engine_restarts=-1"], ["sync.engine_restarts", ">= 0"]),
    (["sync.transport=nfs"], ["sync.transport", "filesystem"]),
    (["generator.block_size=24"], ["generator.block_size", "multiple of 16"]),
    (["reward.weights=[1,2]"], ["reward.weights"]),
    (["reward.functions=[gsm8]"], ["reward.functions", "gsm8k", "module:function"]),
    (["reward.functions=[]"], ["reward.functions", "reward.model_path"]),
    (["reward.on_error=ignore"], ["reward.on_error", "stop, zero"]),
    (["reward.timeout_s=0"], ["reward.timeout_s", "> 0"]),
    (["reward.format_pattern=(unclosed"], ["reward.format_pattern", "regex"]),
    (["reward.model_batch_size=0"], ["reward.model_batch_size"]),
    (["reward.overlong_buffer=16"], ["reward.overlong_buffer", "max_new_tokens = 16"]),
    (["reward.overlong_buffer=-1"], ["reward.overlong_buffer"]),
    (["reward.overlong_penalty=-1"], ["reward.overlong_penalty", ">= 0"]),
    (["generator.max_sampling_rounds=0"], ["generator.max_sampling_rounds", ">= 1"]),
    (["generator.dynamic_sampling=true", "generator.samples_per_prompt=1",
      "algorithm.name=reinforce_pp"], ["generator.dynamic_sampling", "samples_per_prompt"]),
    (["run.steps"], ["key=value"]),
    (["trainer.compile=true", "trainer.activation_memory_budget=0"],
     ["trainer.activation_memory_budget", "(0, 1]"]),
    (["trainer.activation_memory_budget=0.8"],
     ["trainer.activation_memory_budget", "trainer.compile: true"]),
])
def test_bad_values_are_one_line_errors_naming_the_key(override, words):
    with pytest.raises(ValueError) as e:
        load_config(None, override)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_missing_recipe_file():
    with pytest.raises(ValueError, match="not found"):
        load_config("no/such/recipe.yaml", [])


def test_unknown_key_in_yaml(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  learning_rate: 0.1\n")
    with pytest.raises(ValueError, match="trainer.learning_rate"):
        load_config(recipe, [])


def test_reward_keys_load():
    cfg = load_config(None, ["reward.functions=[gsm8k,format,mymod:fn]", "reward.weights=[1,0.1,2]",
                             "reward.on_error=zero", "reward.timeout_s=2.5",
                             "reward.overlong_buffer=4", "generator.dynamic_sampling=true",
                             "reward.model_path=/some/rm"])
    assert cfg.reward.functions == ["gsm8k", "format", "mymod:fn"]
    assert cfg.reward.model_path == "/some/rm" and cfg.reward.on_error == "zero"
    assert cfg.generator.dynamic_sampling and cfg.reward.overlong_buffer == 4
    only_rm = load_config(None, ["reward.functions=[]", "reward.model_path=/some/rm"])
    assert only_rm.reward.functions == []


def test_recipe_that_is_a_list_or_a_directory_is_a_one_line_error(tmp_path):
    listed = tmp_path / "list.yaml"
    listed.write_text("- run:\n    steps: 3\n")
    with pytest.raises(ValueError, match="is a YAML list, not a mapping of sections"):
        load_config(listed)
    with pytest.raises(ValueError, match="is a directory: pass the path of a YAML file"):
        load_config(tmp_path)


def test_activation_memory_budget_reaches_the_compiler(monkeypatch):
    """apply_fsdp hands trainer.activation_memory_budget to torch's partitioner before the
    blocks compile (lazily, at their first forward: nothing compiles here; FSDP2 itself is
    tested on real ranks in test_fsdp_step.py)."""
    import torch._functorch.config as functorch_config

    from llamarl.parallel import fsdp
    from llamarl.tiny.model import build_model
    from llamarl.trainer import linear_logprobs

    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kwargs: module)
    monkeypatch.setattr(functorch_config, "activation_memory_budget", 1.0)
    model, _ = build_model(seed=0)
    try:
        fsdp.apply_fsdp(model, None, torch.float32, compile=True, activation_memory_budget=0.6)
        assert functorch_config.activation_memory_budget == 0.6
    finally:
        linear_logprobs.use_compiled(False)


def test_every_registered_rollout_source_is_a_source_class():
    """registry/sources.py names each built-in once: its class imports, is a RolloutSource,
    and an episodic one has the runner() that continuous generation drives."""
    from llamarl.registry.sources import SOURCES
    from llamarl.rollout.source import RolloutSource, source_class

    for name, entry in SOURCES.items():
        cls = source_class(name)
        assert issubclass(cls, RolloutSource) and entry.path.endswith(":" + cls.__name__)
        assert not cls.episodic or callable(getattr(cls, "runner", None)), name
    assert not source_class("single_turn").episodic
    assert source_class("multi_turn").episodic and source_class("agent").episodic
    with pytest.raises(ValueError, match="use single_turn, multi_turn, agent or 'module:Class'"):
        load_config(None, ["rollout.source=nope"])
