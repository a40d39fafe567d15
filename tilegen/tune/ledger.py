"""The study as a ledger of configs: what counts toward the budget, which configs have a result,
who runs a config two trials proposed at once (the claim), and what to explore after a repeat.

Every reader goes through Optuna's storage, so the answers hold across the workers of one
session and across hosts sharing a study.
"""

from __future__ import annotations

import random
import time
import warnings
from typing import Any

from tilegen.tune.space import SearchSpace

#: how long a trial waits for a lower-numbered one to finish suggesting before it looks
SUGGEST_WAIT_S = 10.0


class TrialLedger:
    """Reads and claims on one study's trials (`optuna.Study`) over its search space."""

    def __init__(self, optuna: Any, study: Any, space: SearchSpace, sampler_seed: int) -> None:
        self.optuna = optuna
        self.study = study
        self.space = space
        self.sampler_seed = sampler_seed
        self.TS = optuna.trial.TrialState
        self.all_names = {c.name for c in space.configs()}

    def counted(self) -> int:
        """Trials with a result (COMPLETE + PRUNED), all sessions and hosts: the budget."""
        return len(self.study.get_trials(deepcopy=False,
                                         states=(self.TS.COMPLETE, self.TS.PRUNED)))

    def fail_stale(self) -> int:
        """Fail the RUNNING trials whose heartbeat stopped (a killed session) and queue them
        again (Optuna's callback); return how many."""
        before = len(self.study.get_trials(deepcopy=False, states=(self.TS.FAIL,)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.optuna.storages.fail_stale_trials(self.study)
        return len(self.study.get_trials(deepcopy=False, states=(self.TS.FAIL,))) - before

    def measured(self) -> set[str]:
        """Configs with a result of their own in the study."""
        out = set()
        for t in self.study.get_trials(deepcopy=False,
                                       states=(self.TS.COMPLETE, self.TS.PRUNED)):
            if t.user_attrs.get("duplicate_of") is None and t.user_attrs.get("config"):
                out.add(t.user_attrs["config"])
        return out

    def exhausted(self) -> bool:
        """Every config of the space has a result."""
        return self.all_names <= self.measured()

    def same_config(self, number: int, name: str) -> Any:
        """An earlier trial of the same config: finished (its result answers this one) or
        running (a lower-numbered one keeps it). Every trial records its ``config`` before it
        looks; a lower-numbered running trial that has not recorded one yet is still
        suggesting, so this waits for it (briefly) rather than guess, and of two trials that
        start the same config at once exactly one runs it."""
        deadline = time.monotonic() + SUGGEST_WAIT_S
        while True:
            pending = False
            for t in self.study.get_trials(deepcopy=False, states=(
                    self.TS.COMPLETE, self.TS.PRUNED, self.TS.RUNNING)):
                if t.number == number or t.user_attrs.get("duplicate_of") is not None:
                    continue
                if t.state == self.TS.RUNNING and t.number > number:
                    continue
                other = t.user_attrs.get("config")
                if other is None:
                    pending = pending or t.state == self.TS.RUNNING
                    continue
                if other == name:
                    return t
            if not pending or time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def queue_unseen(self, number: int) -> None:
        """After a repeated proposal: queue one config no trial has, so the next explores."""
        taken = set()
        for t in self.study.get_trials(deepcopy=False):
            if t.params and set(t.params) == set(self.space.names):
                taken.add(self.space.config(t.params).name)
            fixed = t.system_attrs.get("fixed_params")
            if fixed and set(fixed) == set(self.space.names):
                taken.add(self.space.config(fixed).name)
        unseen = [c for c in self.space.configs() if c.name not in taken]
        feasible = [c for c in unseen if not self.space.violations(c)]
        if feasible or unseen:
            pick = random.Random(f"{self.sampler_seed}:{number}").choice(feasible or unseen)
            self.study.enqueue_trial(self.space.params(pick), user_attrs={"explore": True},
                                     skip_if_exists=True)
