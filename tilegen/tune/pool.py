"""The session's workers: one persistent worker process per GPU (`objective.WorkerHandle`),
started in parallel, handed out to Optuna's threads one trial at a time."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from queue import Queue

from tilegen.tune.objective import WorkerHandle, WorkerInfo, WorkerSetup


class PoolError(RuntimeError):
    """The workers cannot serve one study (too few GPUs, devices of several kinds)."""


def gpu_slots(workers: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES values for `workers` workers (None: leave the env alone)."""
    if workers == 1:
        return [None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        ids = [x.strip() for x in visible.split(",") if x.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    if not ids:
        return [None] * workers  # CPU (Triton interpreter): N CPU workers
    if workers > len(ids):
        raise PoolError(f"--workers {workers} but only {len(ids)} GPU(s) are visible")
    return ids[:workers]


class WorkerPool:
    """`start` spawns and sets up every worker at once; `get`/`put` lend one to a trial."""

    def __init__(self, setup: WorkerSetup, workers: int, setup_timeout_s: float) -> None:
        self.handles = [WorkerHandle(setup, gpu=g, setup_timeout_s=setup_timeout_s,
                                     label=f"worker{i}" + (f"@gpu{g}" if g else ""))
                        for i, g in enumerate(gpu_slots(workers))]
        self._idle: Queue[WorkerHandle] = Queue()

    def __len__(self) -> int:
        return len(self.handles)

    def start(self, say: Callable[[str], None]) -> WorkerInfo:
        """Set every worker up (captures, references, fp32 oracle check); the first's info."""
        say(f"tune: starting {len(self.handles)} worker(s) (captures, references, fp32 "
            "oracle check) ...")
        with ThreadPoolExecutor(len(self.handles)) as pool:
            infos = list(pool.map(lambda h: h.start(), self.handles))
        for h in self.handles:
            self._idle.put(h)
        names = {i.device_name for i in infos}
        if len(names) > 1:
            raise PoolError(f"workers see different devices {sorted(names)}; a study is "
                            "per device kind: pin --workers to GPUs of one kind")
        return infos[0]

    def get(self) -> WorkerHandle:
        return self._idle.get()

    def put(self, handle: WorkerHandle) -> None:
        self._idle.put(handle)

    def close(self) -> None:
        for h in self.handles:
            with contextlib.suppress(Exception):
                h.close()
