"""Test hook (on PYTHONPATH of a tuning subprocess only): Optuna's heartbeat thread writes each
trial's first beat 3 s late, as a thread that lost the SQLite lock under load does. A session
killed inside that window must still leave a trial that a later session finds stale."""

import time

import optuna.storages._rdb.storage as _rdb

_beaten: set[int] = set()
_record = _rdb.RDBStorage.record_heartbeat


def _late_first_beat(self, trial_id: int) -> None:
    import threading

    # Optuna's beat thread runs HeartbeatThread._record_heartbeat (its name says so)
    if trial_id not in _beaten and "_record_heartbeat" in threading.current_thread().name:
        _beaten.add(trial_id)
        time.sleep(3)
    _record(self, trial_id)


_rdb.RDBStorage.record_heartbeat = _late_first_beat
