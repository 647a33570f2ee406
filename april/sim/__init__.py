"""The rollout simulator: `simulate(policy, cfg)`, `compare(cfg)` and their report.

run.py drives the policies over engine.py's continuous-batching engines; config.py holds the
settings and presets; report.py the results, the table and the plot."""

from april.sim.config import POLICIES, PRESETS, SimConfig
from april.sim.report import SimResult, format_table, headline, plot
from april.sim.run import WaveRollout, compare, simulate

__all__ = [
    "POLICIES",
    "PRESETS",
    "SimConfig",
    "SimResult",
    "WaveRollout",
    "compare",
    "format_table",
    "headline",
    "plot",
    "simulate",
]
