"""Prompt data for the generators: local datasets (JSONL, Parquet, save_to_disk) or the embedded
synthetic task, the field mapping and chat template, and the resumable per-engine loader.

    sources.py   files -> rows                 prompts.py   row -> Example -> token ids
    dataset.py   train / held-out split, bad rows      loader.py    sharded, shuffled, stateful

This package must stay importable without pyarrow or torch at module level for `sources`
(config validation uses `sources.detect_format` before anything heavy is imported).
"""
