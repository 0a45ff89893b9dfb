"""Training runs and their checkpoints as the SDK's RestClient lists them, read from the
service's checkpoint directory (service.dir) and its live models (docs/service.md).

A training run is a training client's model id (`<session>:train:<n>`); its checkpoints are
the directories that save_state (`weights/<name>`) and save_weights_for_sampler
(`sampler_weights/<name>`) wrote under `service.dir/<model id, made safe>/`, each complete
once its meta.json exists (written last). So runs of earlier server processes are listed
too: their checkpoints are on disk, and `create_training_client_from_state` takes them.
Answers are the SDK's own pydantic types (tinker.types), as JSON.
"""

from __future__ import annotations

import json
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path

KINDS = {"weights": "training", "sampler_weights": "sampler"}  # directory -> checkpoint_type
SCHEME = "tinker://"


def safe_name(model_id: str) -> str:
    """A model id as a directory name."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", model_id)


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat()


def _checkpoint(model_id: str, directory: Path) -> dict:
    """The SDK's Checkpoint for the complete checkpoint in `directory`."""
    kind, name = directory.parent.name, directory.name
    files = [f for f in directory.rglob("*") if f.is_file()]
    return {"checkpoint_id": f"{kind}/{name}", "checkpoint_type": KINDS[kind],
            "time": _when((directory / "meta.json").stat().st_mtime),
            "tinker_path": f"{SCHEME}{model_id}/{kind}/{name}",
            "size_bytes": sum(f.stat().st_size for f in files), "public": False}


class RunStore:
    """The runs under `directory` (service.dir), for the listing routes."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def run_dirs(self) -> dict[str, Path]:
        """{model id: its directory} for every run with at least one complete checkpoint
        (the model id read from a checkpoint's meta.json: directory names are made safe)."""
        runs: dict[str, Path] = {}
        if not self.directory.is_dir():
            return runs
        for run in sorted(self.directory.iterdir()):
            metas = sorted(run.glob("*/*/meta.json"))
            if metas:
                runs[json.loads(metas[0].read_text())["model_id"]] = run
        return runs

    def run_dir(self, model_id: str) -> Path | None:
        run = self.directory / safe_name(model_id)
        return run if run.is_dir() else None

    def checkpoints(self, model_id: str, run: Path | None) -> list[dict]:
        """A run's complete checkpoints, oldest first."""
        if run is None:
            return []
        found = [d for kind in KINDS for d in (run / kind).glob("*")
                 if (d / "meta.json").is_file()]
        return sorted((_checkpoint(model_id, d) for d in found), key=lambda c: c["time"])

    def training_run(self, model_id: str, run: Path | None, base_model: str,
                     live: dict | None) -> dict:
        """The SDK's TrainingRun. `live`: {"rank", "last_request"} of a model this server holds
        now; a run known from disk alone takes its spec and time from its last checkpoint."""
        checkpoints = self.checkpoints(model_id, run)
        if live is None and not checkpoints:
            raise KeyError(f"no training run {model_id!r} on this server (none live, none "
                           f"saved under {self.directory})")
        last = {t: next((c for c in reversed(checkpoints) if c["checkpoint_type"] == t), None)
                for t in KINDS.values()}
        if live is not None:
            rank, when = live["rank"], _when(live["last_request"])
        else:
            newest = checkpoints[-1]
            kind, name = newest["checkpoint_id"].split("/", 1)
            rank = json.loads((run / kind / name / "meta.json").read_text())["spec"]["rank"]
            when = newest["time"]
        return {"training_run_id": model_id, "base_model": base_model, "model_owner": "local",
                "is_lora": True, "lora_rank": rank, "last_request_time": when,
                "last_checkpoint": last["training"],
                "last_sampler_checkpoint": last["sampler"]}

    def delete(self, model_id: str, run: Path | None, checkpoint_id: str) -> None:
        """Remove one checkpoint (`weights/<name>` or `sampler_weights/<name>`)."""
        kind, _, name = checkpoint_id.partition("/")
        if kind not in KINDS or not name or "/" in name or name in (".", ".."):
            raise ValueError(f"checkpoint id {checkpoint_id!r}: give weights/<name> or "
                             "sampler_weights/<name>")
        target = None if run is None else run / kind / name
        if target is None or not (target / "meta.json").is_file():
            raise KeyError(f"no checkpoint {checkpoint_id!r} of training run {model_id!r}")
        (target / "meta.json").unlink()  # (first: a half-removed directory is not listed)
        shutil.rmtree(target)


def page(items: list, limit: int | None, offset: int | None) -> tuple[list, dict]:
    """(the page, the SDK's Cursor) of `items`."""
    offset = max(int(offset or 0), 0)
    limit = len(items) if limit is None else max(int(limit), 0)
    return items[offset:offset + limit], {"offset": offset, "limit": limit,
                                         "total_count": len(items)}
