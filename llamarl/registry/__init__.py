"""Name tables, torch-free and below the recipe schema: every name a recipe may use for an
algorithm, a rollout source, an environment, an agent or a model, with the import path of what
it names. config.py validates against these; the packages resolve them (imports.py) when they
run. Adding a thing by name is one line here and one file where it lives."""
