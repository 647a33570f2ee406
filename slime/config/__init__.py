"""The job configuration, one module per reader: base.py (the strict model, ConfigError),
inputs.py (model, data, sampling), rollout.py (rollout workers, engines, APRIL's scheduling),
learner.py (algorithm, its settings and corrections, learner), services.py (reward, env, buffer,
weights, cluster, logging, dashboard), job.py (the JobConfig root, loading, overrides, env
references, display), renames.py (keys that moved). Everything public is importable from
`slime.config`."""

from slime.config.base import ConfigError, StrictModel
from slime.config.inputs import (
    CurriculumStage,
    DataConfig,
    ModelConfig,
    SamplingConfig,
    TaskWeighting,
    TinyModelConfig,
    WarmstartConfig,
)
from slime.config.job import (
    ENV_REFERENCE,
    JobConfig,
    apply_overrides,
    config_for_display,
    dump_config,
    format_validation_error,
    load_config,
    parse_override,
)
from slime.config.learner import (
    AdaptiveClipConfig,
    AlgorithmConfig,
    CispoConfig,
    CorrectionConfig,
    DrGrpoConfig,
    GspoConfig,
    LearnerConfig,
    StagedKL,
)
from slime.config.renames import RENAMED, ConfigKeyDeprecated
from slime.config.rollout import AprilConfig, ElasticRolloutConfig, RolloutConfig, SglangConfig, VllmConfig
from slime.config.services import (
    BufferConfig,
    ClusterConfig,
    DashboardConfig,
    EnvConfig,
    LoggingConfig,
    RewardConfig,
    WeightsConfig,
    resolve_weight_transport,
)

__all__ = [
    "ENV_REFERENCE",
    "AdaptiveClipConfig",
    "AlgorithmConfig",
    "AprilConfig",
    "CispoConfig",
    "ConfigKeyDeprecated",
    "CorrectionConfig",
    "DrGrpoConfig",
    "GspoConfig",
    "RENAMED",
    "BufferConfig",
    "ClusterConfig",
    "ConfigError",
    "CurriculumStage",
    "DashboardConfig",
    "DataConfig",
    "ElasticRolloutConfig",
    "EnvConfig",
    "JobConfig",
    "LearnerConfig",
    "LoggingConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "SamplingConfig",
    "SglangConfig",
    "StagedKL",
    "StrictModel",
    "TaskWeighting",
    "TinyModelConfig",
    "VllmConfig",
    "WarmstartConfig",
    "WeightsConfig",
    "apply_overrides",
    "config_for_display",
    "dump_config",
    "format_validation_error",
    "load_config",
    "parse_override",
    "resolve_weight_transport",
]
