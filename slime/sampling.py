"""Which prompt comes next: an epoch-by-epoch walk, task weighting and a curriculum.

- Plain: a seeded order (shuffled anew each epoch when shuffle=True) walked with a cursor.
- sampling.tasks: pick a task with probability ∝ its weight, then that task's next prompt (each
  task walks its own order). After every step, each task whose mean reward over its last
  `window` observed steps is below its target has its weight multiplied by `grow`; then the
  weights are renormalised (GLM-5 report, multi-task sampling).
- sampling.curriculum: only prompts whose metadata match the current stage's filter are drawn;
  once `window` steps have been observed in a stage and their mean reward (all tasks) reaches
  advance_at_reward, the next stage starts (the last stage stays).

Each epoch's order is a function of (seed, stage, task, epoch), so a checkpoint only needs the
cursors, the weights, the reward windows and the task-choice RNG state: a resumed job draws
exactly the prompts that the uninterrupted job would have drawn.
"""

from __future__ import annotations

import logging
import random
from collections import Counter, deque
from typing import Any

from slime.config import ConfigError, CurriculumStage, SamplingConfig
from slime.data import PromptRecord

_ALL = "*"  # the pool key when tasks are not weighted
log = logging.getLogger(__name__)


class _Pool:
    """The records of one task (or all) in the current stage, walked epoch after epoch."""

    def __init__(self, members: list[int], seed_key: str, shuffle: bool) -> None:
        self.members = members
        self.seed_key = seed_key
        self.shuffle = shuffle
        self.cursor = 0
        self.epoch = 0
        self.order = self._order()

    def _order(self) -> list[int]:
        order = list(self.members)
        if self.shuffle:
            random.Random(f"{self.seed_key}:{self.epoch}").shuffle(order)
        return order

    def next(self) -> int:
        if self.cursor >= len(self.order):
            self.epoch += 1
            self.cursor = 0
            self.order = self._order()
        self.cursor += 1
        return self.order[self.cursor - 1]

    def seek(self, cursor: int, epoch: int) -> None:
        self.cursor, self.epoch = cursor, epoch
        self.order = self._order()


class PromptSampler:
    def __init__(
        self,
        records: list[PromptRecord],
        cfg: SamplingConfig,
        task_key: str,
        seed: int,
        shuffle: bool,
    ) -> None:
        if not records:
            raise ConfigError("PromptSampler needs at least one prompt record")
        self.records = records
        self.cfg = cfg
        self.task_key = task_key
        self.seed = seed
        self.shuffle = shuffle
        self._rng = random.Random(seed)  # the task choice; orders have their own seeds
        self.draws = 0  # prompts drawn so far in the run: each group in the buffer records its own
        self._weights: dict[str, float] = {}
        if cfg.tasks is not None:
            total = sum(cfg.tasks.weights.values())
            if not cfg.tasks.weights or total <= 0:
                raise ConfigError("sampling.tasks.weights must give at least one task a positive weight")
            self._weights = {t: w / total for t, w in cfg.tasks.weights.items()}
            rows = Counter(self._task_of(r) for r in records)
            for task in self._weights:
                if not rows.get(task):
                    raise ConfigError(
                        f"sampling.tasks.weights names task {task!r}, but no record has "
                        f"metadata[{task_key!r}] == {task!r}; tasks in the data: {sorted(map(str, rows))[:20]}"
                    )
            for task in cfg.tasks.targets:
                if task not in self._weights:
                    raise ConfigError(f"sampling.tasks.targets names task {task!r}, which tasks.weights does not list")
            unlisted = {str(t): n for t, n in rows.items() if t not in self._weights}
            if unlisted:
                log.warning(
                    "sampling.tasks.weights lists no weight for %s (%d prompt records): they are never drawn",
                    ", ".join(f"{t!r} ({n})" for t, n in sorted(unlisted.items())[:20]),
                    sum(unlisted.values()),
                )
        self._task_windows: dict[str, deque[float]] = {}
        self._stage_window: deque[float] = deque(maxlen=cfg.window)
        self._stage = 0
        for i in range(len(cfg.curriculum)):
            self._build_pools(i)  # fail at start, not hours later, on a stage that matches nothing
        self._pools = self._build_pools(self._stage)

    # ---- drawing -------------------------------------------------------------------------

    def _task_of(self, record: PromptRecord) -> str | None:
        """The record's task as text (the config's task names are text; a column of numbers too)."""
        task = record.metadata.get(self.task_key)
        return None if task is None else str(task)

    def _build_pools(self, stage_index: int) -> dict[str, _Pool]:
        members = list(range(len(self.records)))
        stage_tag = "-"
        if self.cfg.curriculum:
            stage = self.cfg.curriculum[stage_index]
            members = [i for i in members if _matches(self.records[i], stage)]
            stage_tag = str(stage_index)
            if self._weights:
                members = [i for i in members if self._task_of(self.records[i]) in self._weights]
            if not members:
                raise ConfigError(
                    f"sampling.curriculum stage {stage.name!r} (filter {stage.filter}) matches no prompt record"
                    + (" of a weighted task" if self._weights else "")
                )
        if not self._weights:
            return {_ALL: _Pool(members, f"{self.seed}:{stage_tag}:{_ALL}", self.shuffle)}
        pools = {}
        for task in self._weights:
            task_members = [i for i in members if self._task_of(self.records[i]) == task]
            if task_members:  # a task absent from this stage is skipped while the stage lasts
                pools[task] = _Pool(task_members, f"{self.seed}:{stage_tag}:{task}", self.shuffle)
        return pools

    def next(self) -> PromptRecord:
        if self._weights:
            tasks = list(self._pools)
            task = self._rng.choices(tasks, weights=[self._weights[t] for t in tasks])[0]
        else:
            task = _ALL
        self.draws += 1
        return self.records[self._pools[task].next()]

    # ---- feedback ------------------------------------------------------------------------

    def observe(self, rewards_by_task: dict[str, list[float]]) -> None:
        """Record one step's rewards, then update the task weights and the curriculum stage."""
        for task, rewards in rewards_by_task.items():
            if rewards:
                window = self._task_windows.setdefault(task, deque(maxlen=self.cfg.window))
                window.append(sum(rewards) / len(rewards))
        if self.cfg.tasks is not None:
            targets = self.cfg.tasks.targets
            for task in self._weights:
                window = self._task_windows.get(task)
                if task in targets and window and sum(window) / len(window) < targets[task]:
                    self._weights[task] *= self.cfg.tasks.grow
            total = sum(self._weights.values())
            self._weights = {t: w / total for t, w in self._weights.items()}

        all_rewards = [r for rewards in rewards_by_task.values() for r in rewards]
        if self.cfg.curriculum and all_rewards:
            self._stage_window.append(sum(all_rewards) / len(all_rewards))
            threshold = self.cfg.curriculum[self._stage].advance_at_reward
            if (
                threshold is not None
                and self._stage + 1 < len(self.cfg.curriculum)
                and len(self._stage_window) == self.cfg.window
                and sum(self._stage_window) / len(self._stage_window) >= threshold
            ):
                self._stage += 1
                self._stage_window.clear()  # the next stage is judged on its own rewards
                self._pools = self._build_pools(self._stage)

    # ---- logging -------------------------------------------------------------------------

    @property
    def current_stage(self) -> str | None:
        return self.cfg.curriculum[self._stage].name if self.cfg.curriculum else None

    @property
    def current_stage_index(self) -> int | None:
        """The stage's position in sampling.curriculum (0 first): a number the metrics can plot."""
        return self._stage if self.cfg.curriculum else None

    @property
    def task_weights(self) -> dict[str, float]:
        return dict(self._weights)

    # ---- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; load it into a sampler built with the same records and config."""
        version, internal, gauss = self._rng.getstate()
        return {
            "num_records": len(self.records),
            "stage": self._stage,
            "pools": {k: {"cursor": p.cursor, "epoch": p.epoch} for k, p in self._pools.items()},
            "weights": dict(self._weights),
            "task_windows": {t: list(w) for t, w in self._task_windows.items()},
            "stage_window": list(self._stage_window),
            "rng": [version, list(internal), gauss],
            "draws": self.draws,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_records"] != len(self.records):
            raise ValueError(
                f"sampler state was saved with {state['num_records']} prompt records, this dataset has "
                f"{len(self.records)}: resuming would not continue the same data order"
            )
        self._stage = int(state["stage"])
        self._pools = self._build_pools(self._stage)
        for key, pool_state in state["pools"].items():
            self._pools[key].seek(int(pool_state["cursor"]), int(pool_state["epoch"]))
        self._weights = {t: float(w) for t, w in state["weights"].items()}
        self._task_windows = {
            t: deque((float(x) for x in w), maxlen=self.cfg.window) for t, w in state["task_windows"].items()
        }
        self._stage_window = deque((float(x) for x in state["stage_window"]), maxlen=self.cfg.window)
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self.draws = int(state.get("draws", 0))  # absent: a checkpoint from before it was kept


def _matches(record: PromptRecord, stage: CurriculumStage) -> bool:
    return all(key in record.metadata and record.metadata[key] == value for key, value in stage.filter.items())


def fast_forward(sampler: PromptSampler, later: dict[int, tuple[int | None, str]]) -> int:
    """A resume's sampler, restored from its checkpoint, walks on over the groups the buffer holds from
    after it (draw -> (record index, status): TrajectoryStore.groups_drawn_after), as long as it
    draws exactly their prompts, in draw order: those groups go on (a partial from its stored tokens,
    an agent episode from its stored state) and their prompts are not drawn again (one a filter
    dropped stays dropped, as in the run that drew it). It stops before a gap, a trained group (its
    update is not in the checkpoint) or a prompt it would draw differently; returns how many prompts
    it has drawn then: the groups drawn after that are for the buffer to drop. With a curriculum it
    does not walk: a stage that advanced after the checkpoint draws from another pool, where the
    same index may come up by chance."""
    if sampler.cfg.curriculum:
        return sampler.draws
    for draw in sorted(later):
        index, status = later[draw]
        if draw != sampler.draws + 1 or index is None or status == "trained":
            break
        before = sampler.state_dict()
        if sampler.next().index != index:
            sampler.load_state_dict(before)
            break
    return sampler.draws
