"""Keys set one after another in the job's TCPStore (`<prefix>/0`, `<prefix>/1`, ...), followed
in order by a thread blocked in the store, so a waiting rank wakes the moment the next is set
instead of polling the store.

Used for the trainer's weight-sync announcements (`wsync/version/<i>`, generator/weights.py)
and for the pushes of a rollout channel (`buf/<channel>/queue/pushed/<seq>`,
buffer/channel.py). The thread has a store connection of its own (threads must not share
one) and waits there with a long timeout: c10d logs every store wait that times out, and
waiting in the store with a 1 s timeout from the main thread logged two 'waitForInput ...
timed out' lines per second while the trainer trained (570 lines in a 7-minute run). The
caller waits on a condition for as long as it likes between its other checks (the watchdog,
its queue), so a key that is never set costs it nothing but that key's wake-up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

_WATCH_S = 3600.0  # the thread's store waits


class KeySequence:
    """Follows `<prefix>/<first>`, `<prefix>/<first + 1>`, ... in order; `count` is one past the
    last key seen. `delete`: remove each key once seen (keys that would otherwise pile up in
    the store, one per batch)."""

    def __init__(self, make_store: Callable[[], object], prefix: str, first: int = 0,
                 delete: bool = False, name: str = "llamarl-keys"):
        self.prefix, self.delete = prefix, delete
        self.count = first
        self._cv = threading.Condition()
        threading.Thread(target=self._watch, args=(make_store,), daemon=True, name=name).start()

    def _watch(self, make_store) -> None:
        try:
            store = make_store()
            while True:
                key = f"{self.prefix}/{self.count}"
                try:
                    store.wait([key], timedelta(seconds=_WATCH_S))
                except dist.DistStoreError as e:
                    if "timeout" in str(e).lower():  # (wait again)
                        continue
                    raise
                if self.delete:
                    store.delete_key(key)
                with self._cv:
                    self.count += 1
                    self._cv.notify_all()
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending or failed
            return  # (the caller's watchdog names the cause)

    def seen(self, index: int, timeout_s: float = 0.0) -> bool:
        """Whether key `index` was seen, waiting up to `timeout_s` for it."""
        with self._cv:
            if timeout_s > 0:
                self._cv.wait_for(lambda: self.count > index, timeout_s)
            return self.count > index
