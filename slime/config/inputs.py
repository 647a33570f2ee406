"""What the job starts from: the policy (`model.*`), the prompts (`data.*`) and how they are drawn
(`sampling.*`), and the held-out prompts it is measured on (`eval.*`). Read by slime/model.py,
slime/data.py, slime/sampling.py and slime/evaluation.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from slime.config.base import StrictModel as _Strict

# Far past what a model built in code for a CPU test is, and short of an allocation that fails mid-run.
MAX_TINY_DIM = 1 << 16
# Rows, prompts, samples and workers: past these a value is a typo (1e23 loaded, then ran out of memory).
MAX_COUNT = 10_000_000


class TinyModelConfig(_Strict):
    """The built-in default policy: a Qwen3-MoE built in code with a character-level tokenizer."""

    hidden_size: int = Field(128, gt=0, le=MAX_TINY_DIM)
    num_layers: int = Field(4, gt=0, le=MAX_TINY_DIM)
    num_heads: int = Field(4, gt=0, le=MAX_TINY_DIM)
    num_kv_heads: int = Field(2, gt=0, le=MAX_TINY_DIM)
    num_experts: int = Field(8, gt=0, le=MAX_TINY_DIM)
    experts_per_token: int = Field(2, gt=0, le=MAX_TINY_DIM)
    expert_hidden_size: int = Field(128, gt=0, le=MAX_TINY_DIM)
    max_position_embeddings: int = Field(512, gt=0, le=MAX_TINY_DIM)

    @model_validator(mode="after")
    def _check(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError("model.tiny.hidden_size must be divisible by model.tiny.num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.tiny.num_heads must be divisible by model.tiny.num_kv_heads")
        if self.experts_per_token > self.num_experts:
            raise ValueError("model.tiny.experts_per_token cannot exceed model.tiny.num_experts")
        return self


class WarmstartConfig(_Strict):
    """Short supervised pass on generated demonstrations of the example task (cached on disk)."""

    enabled: bool = True
    steps: int = Field(100, ge=0)
    batch_size: int = Field(32, gt=0)
    lr: float = Field(3e-3, gt=0)
    num_examples: int = Field(4000, gt=0)


class ModelConfig(_Strict):
    path: str | None = Field(
        None, description="Local Hugging Face causal LM directory (with tokenizer); None builds the tiny MoE."
    )
    tiny: TinyModelConfig = TinyModelConfig()
    warmstart: WarmstartConfig = WarmstartConfig()
    cache_dir: str = Field("~/.cache/slime-april", description="Where the built tiny model is cached.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = 0


class DataConfig(_Strict):
    path: str | None = Field(
        None, description="JSONL, Parquet or a local HF dataset directory; None generates the example task."
    )
    prompt_key: str = "prompt"
    label_key: str = Field(
        "label", description="The label column; a dotted key reads a nested field (reward_model.ground_truth)."
    )
    task_key: str = "task"
    apply_chat_template: bool | None = Field(
        None,
        description="Text prompts through the tokenizer's chat template (true) or as they are (false; None, the "
        "default, is false). Chat-message prompts always go through it: false with them is refused.",
    )
    input_template: str | None = Field(
        None,
        description="A text prompt as the model reads it, {} standing for the row's prompt (OpenRLHF's "
        "--input_template), e.g. 'Question: {}\\nAnswer:'; the reward still gets the row's prompt. Not with "
        "apply_chat_template, nor for chat-message prompts.",
    )
    system_prompt: str | None = Field(
        None,
        description="A system message put before each prompt that the chat template renders (text prompts with "
        "apply_chat_template, and chat-message prompts that have no system message of their own).",
    )
    max_prompt_tokens: int = Field(256, gt=0)
    overlong_prompts: Literal["error", "drop"] = Field(
        "error",
        description="A prompt over max_prompt_tokens: error (the load stops, naming the row) or drop (skipped, "
        "counted in a warning; verl's filter_overlong_prompts).",
    )
    shuffle: bool = True
    seed: int = 0
    num_generated: int = Field(
        2000, gt=0, le=MAX_COUNT, description="Prompts generated for the example task when path is None."
    )

    @model_validator(mode="after")
    def _one_prompt_format(self) -> DataConfig:
        if self.input_template is not None and self.input_template.count("{}") != 1:
            raise ValueError(f"data.input_template={self.input_template!r} must hold {{}} once: where the prompt goes")
        if self.input_template is not None and self.apply_chat_template:
            raise ValueError("data.input_template and data.apply_chat_template both format a text prompt: choose one")
        if self.system_prompt is not None and self.input_template is not None:
            raise ValueError(
                "data.system_prompt goes through the chat template; data.input_template formats text without one: "
                "put the system text in the template, or set data.apply_chat_template=true instead"
            )
        return self


class TaskWeighting(_Strict):
    """GLM-5 report 4.7: weights rise (x grow) for tasks scoring below their target, then renormalise."""

    weights: dict[str, float] = Field(default_factory=dict)
    targets: dict[str, float] = Field(default_factory=dict)
    grow: float = Field(1.1, gt=1)


class CurriculumStage(_Strict):
    name: str
    filter: dict[str, Any] = Field(default_factory=dict, description="Metadata equalities a prompt must match.")
    advance_at_reward: float | None = Field(None, description="Mean reward (recent window) that ends the stage.")


class SamplingConfig(_Strict):
    tasks: TaskWeighting | None = None
    curriculum: list[CurriculumStage] = Field(default_factory=list)
    window: int = Field(4, gt=0, description="Steps of reward history used by task weights and curriculum.")


class EvalConfig(_Strict):
    """Held-out evaluation (slime/evaluation.py): `slime eval`, and every `every_steps` inside the job."""

    every_steps: int = Field(
        0,
        ge=0,
        description="Evaluate on the rollout engines every N steps and at the end, logged as eval/* (0: never).",
    )
    data: str | None = Field(
        None, description="Held-out prompts (read like data.path); None with the example task: new prompts of it."
    )
    num_prompts: int | None = Field(
        None,
        gt=0,
        le=MAX_COUNT,
        description="eval.data's first N rows (None: all); the example task's held-out set size (64).",
    )
    samples: int = Field(0, ge=0, description="Sampled responses per prompt besides the greedy one (pass@1, pass@k).")
    temperature: float = Field(
        1.0, ge=1e-6, le=100, description="Temperature of the sampled responses, in [1e-6, 100] (as every engine)."
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus mass of the sampled responses (1: off); not rollout.top_p."
    )
    top_k: int = Field(0, ge=0, description="Top-k of the sampled responses (0: off); not rollout.top_k.")
    max_new_tokens: int | None = Field(None, gt=0, description="Response budget; None: rollout.max_new_tokens.")
    pass_threshold: float = Field(1.0, description="A response passes when its reward is at least this.")
    seed: int = Field(
        0,
        description="Seed of the sampled responses: each has a stream of its own, from this seed, its prompt and its index.",
    )
