"""CheckpointManager: periodic asynchronous checkpoints with retention, in
the manner of Orbax's CheckpointManager."""

from __future__ import annotations

import os
import threading
from typing import Any, List, Mapping, Optional

from . import _core
from ._lib import FerryError
from ._shards import PathLike, StateDict


class CheckpointManager:
    """Saves a state every `save_interval_steps` steps under `root`, keeps the
    `keep_last` newest checkpoints (None keeps all), restores the latest.

        with ferry.CheckpointManager("/ckpt", save_interval_steps=100, keep_last=3) as mgr:
            start = (mgr.latest_step() or 0)
            if start:
                mgr.restore(state={"model": model, "optim": opt})
            for step in range(start + 1, steps + 1):
                train_step()
                mgr.save(step, {"model": model, "optim": opt})

    save() returns once the state's bytes are copied off the tensors (the
    snapshot), so training may go on mutating them; the write and commit
    run in the background, and so does the deletion of checkpoints past
    keep_last (a thread of its own: deleting gigabytes can take seconds).
    The state may hold tensors, nested dicts, JSON values, ferry.Shard
    entries and objects with state_dict() / load_state_dict() (modules,
    optimizers)."""

    def __init__(self, root: PathLike, save_interval_steps: int = 1, keep_last: Optional[int] = None,
                 runtime: Optional[_core.Runtime] = None) -> None:
        if save_interval_steps < 1:
            raise ValueError("save_interval_steps must be >= 1")
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be None or >= 1")
        self.root = os.fspath(root)
        self.save_interval_steps = int(save_interval_steps)
        self.keep_last = keep_last
        self._rt = runtime
        self._pending = []  # saves not yet known committed, oldest first
        self._last_saved = None
        self._retention = None  # (thread, errors) of the retention in flight
        self._retain_due = False  # a commit came while it ran

    @property
    def runtime(self) -> _core.Runtime:
        return self._rt or _core.default_runtime()

    def should_save(self, step: int) -> bool:
        if step == self._last_saved:
            return False
        return step % self.save_interval_steps == 0

    def save(self, step: int, state: StateDict, force: bool = False,
             metadata: Optional[Mapping[str, str]] = None) -> bool:
        """Starts a checkpoint of `state` at `step` when should_save(step) (or
        force). Returns whether a save was started. A failure of the previous
        save is raised here."""
        if not force and not self.should_save(step):
            return False
        self._finish_previous(block=False)
        h = _core.save_async(state, self.root, step, metadata=metadata, runtime=self.runtime)
        h.wait_snapshot()  # a save that failed this early is raised here, once
        self._pending.append(h)
        self._last_saved = step
        return True

    def _finish_previous(self, block):
        while self._pending:
            h = self._pending[0]
            if not block and not h.done():
                return
            self._pending.pop(0)
            h.wait()  # raises the failure of that save, if any
            self._retain()

    def _retain(self):
        # Rank 0 alone deletes: it is the one that commits. One retention at
        # a time; ctypes lets go of the GIL, so training runs meanwhile.
        if not (self.keep_last and self.runtime.rank == 0):
            return
        if self._retention is not None and self._retention[0].is_alive():
            self._retain_due = True  # it may have looked before this commit
            return
        self._join_retention()  # over already: raises its error, if any
        self._retain_due = False
        errors = []

        def run():
            try:
                _core.apply_retention(self.root, self.keep_last)
            except BaseException as e:  # raised in the caller's thread, later
                errors.append(e)

        t = threading.Thread(target=run, name="ferry-retention", daemon=True)
        t.start()
        self._retention = (t, errors)

    def _join_retention(self):
        """Waits for the retention in flight and raises its error, if any."""
        if self._retention is None:
            return
        t, errors = self._retention
        self._retention = None
        t.join()
        if errors:
            raise errors[0]

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight is committed and old checkpoints
        are deleted (raises the error of either)."""
        self._finish_previous(block=True)
        self._join_retention()
        if self._retain_due:
            self._retain()
            self._join_retention()

    def _have_root(self):
        # An s3:// prefix has no directory to look for: an empty one lists nothing.
        return self.root.startswith("s3://") or os.path.isdir(self.root)

    def all_steps(self) -> List[int]:
        return sorted(_core.list_steps(self.root)) if self._have_root() else []

    def latest_step(self) -> Optional[int]:
        if not self._have_root():
            return None
        path = _core.latest(self.root)
        return None if path is None else _core.read_manifest(path).step

    def step_path(self, step: int) -> str:
        return os.path.join(self.root, "step-%08d" % int(step))

    def restore(self, step: Optional[int] = None, state: Optional[StateDict] = None,
                strict: Optional[bool] = None, cast: bool = False,
                key_map: Optional[Mapping[str, str]] = None, allow_pickle: bool = False) -> Any:
        """Loads step (default: the latest, as rank 0 picks it for every
        rank). With `state`, fills it in place (see ferry.load) and returns
        it; without, returns a new state dict."""
        self.wait_until_finished()
        if step is None:
            if not self._have_root() or _core.latest(self.root) is None:
                raise FerryError("no committed checkpoint under %s" % self.root, "not_found")
            path = self.root  # the load resolves the latest, once for every rank
        else:
            path = self.step_path(step)
        if state is None:
            return _core.load_state_dict(path, runtime=self.runtime, allow_pickle=allow_pickle)
        _core.load(state, path, strict=strict, cast=cast, key_map=key_map, runtime=self.runtime,
                   allow_pickle=allow_pickle)
        return state

    def close(self) -> None:
        self.wait_until_finished()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            # Do not hide the original error behind a save's failure.
            try:
                self.close()
            except FerryError:
                pass
        return False
