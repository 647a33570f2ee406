"""Edge values of the job config that used to load and then misbehave (repro/walk_fields.py walks
every field): each is now refused at load, naming the key and the reason."""

from __future__ import annotations

import pytest

from slime.config import ConfigError, load_config

EXAMPLE = "examples/repeat_grpo.yaml"


def _refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, list(overrides))
    return str(info.value)


def test_overlong_buffer_must_leave_room_below_max_new_tokens():
    # With L_cache >= L_max the soft start is <= 0: every response was penalised (overlong_share 1.0).
    msg = _refused("rollout.max_new_tokens=16", "algorithm.overlong_buffer=16")
    assert "algorithm.overlong_buffer=16" in msg and "rollout.max_new_tokens=16" in msg
    assert load_config(EXAMPLE, ["rollout.max_new_tokens=16", "algorithm.overlong_buffer=15"])
