from pathlib import Path

import pytest

from llamarl.config import Config, load_config

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("**/*.yaml"))


def test_defaults_validate():
    cfg = load_config(None, [])
    assert isinstance(cfg, Config) and cfg.trainer.ranks == 2


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_recipe_loads_and_opens_with_its_launch_command(recipe):
    cfg = load_config(recipe, [])
    assert cfg.run.steps > 0
    head = recipe.read_text().splitlines()[:6]
    assert head[0].startswith("#"), "a recipe opens with a comment saying what it trains"
    assert any("torchrun" in line or "srun" in line or "sbatch" in line for line in head)


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
    (["generator.tp=2"], ["generator.tp", "tp=1"]),
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
