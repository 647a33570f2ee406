"""PromptSampler: seeded order, resume from state_dict, task weights, curriculum."""

from __future__ import annotations

import json

import pytest

from slime.config import ConfigError, CurriculumStage, SamplingConfig, TaskWeighting
from slime.data import PromptRecord
from slime.sampling import PromptSampler


def make_records(n: int = 10) -> list[PromptRecord]:
    return [
        PromptRecord(
            index=i,
            prompt=f"p{i}",
            prompt_ids=[i],
            metadata={"task": "math" if i % 2 == 0 else "code", "level": "easy" if i < n // 2 else "hard"},
        )
        for i in range(n)
    ]


def draw(sampler: PromptSampler, n: int) -> list[int]:
    return [sampler.next().index for _ in range(n)]


def test_plain_order_is_seeded_and_covers_each_epoch() -> None:
    records = make_records(10)
    a = draw(PromptSampler(records, SamplingConfig(), "task", seed=3, shuffle=True), 30)
    b = draw(PromptSampler(records, SamplingConfig(), "task", seed=3, shuffle=True), 30)
    c = draw(PromptSampler(records, SamplingConfig(), "task", seed=4, shuffle=True), 30)
    assert a == b
    assert a != c
    for epoch in range(3):
        assert sorted(a[epoch * 10 : (epoch + 1) * 10]) == list(range(10))
    assert a[:10] != a[10:20]  # reshuffled per epoch
    assert draw(PromptSampler(records, SamplingConfig(), "task", seed=3, shuffle=False), 12) == [*range(10), 0, 1]


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(),
        SamplingConfig(tasks=TaskWeighting(weights={"math": 1.0, "code": 3.0}, targets={"math": 0.9})),
        SamplingConfig(
            curriculum=[
                CurriculumStage(name="easy", filter={"level": "easy"}, advance_at_reward=0.5),
                CurriculumStage(name="hard", filter={"level": "hard"}),
            ],
            window=2,
        ),
    ],
    ids=["plain", "tasks", "curriculum"],
)
def test_state_dict_round_trip_resumes_the_same_sequence(cfg: SamplingConfig) -> None:
    records = make_records(10)
    original = PromptSampler(records, cfg, "task", seed=7, shuffle=True)
    draw(original, 7)
    original.observe({"math": [0.1, 0.2], "code": [0.9]})
    original.observe({"math": [0.8], "code": [0.7]})
    draw(original, 5)
    state = json.loads(json.dumps(original.state_dict()))
    expected = draw(original, 25)

    resumed = PromptSampler(records, cfg, "task", seed=7, shuffle=True)
    resumed.load_state_dict(state)
    assert resumed.current_stage == original.current_stage
    assert draw(resumed, 25) == expected
    assert resumed.task_weights == original.task_weights


def test_state_from_another_dataset_is_refused() -> None:
    state = PromptSampler(make_records(10), SamplingConfig(), "task", seed=0, shuffle=True).state_dict()
    with pytest.raises(ValueError, match="10 prompt records"):
        PromptSampler(make_records(12), SamplingConfig(), "task", seed=0, shuffle=True).load_state_dict(state)


def test_task_weight_rises_for_an_under_target_task() -> None:
    tasks = TaskWeighting(weights={"math": 1.0, "code": 1.0}, targets={"math": 0.8, "code": 0.2}, grow=1.1)
    sampler = PromptSampler(make_records(10), SamplingConfig(tasks=tasks, window=2), "task", seed=0, shuffle=True)
    assert sampler.task_weights == pytest.approx({"math": 0.5, "code": 0.5})
    sampler.observe({"math": [0.1, 0.3], "code": [0.9]})  # math mean 0.2 < 0.8; code 0.9 ≥ 0.2
    math_w = 0.5 * 1.1 / (0.5 * 1.1 + 0.5)
    assert sampler.task_weights == pytest.approx({"math": math_w, "code": 1 - math_w})
    sampler.observe({"math": [1.0], "code": [0.9]})  # math window (0.2 + 1.0)/2 = 0.6, still under
    math_w2 = math_w * 1.1 / (math_w * 1.1 + (1 - math_w))
    assert sampler.task_weights["math"] == pytest.approx(math_w2)
    sampler.observe({"math": [1.0], "code": [0.9]})  # window (1.0 + 1.0)/2 reaches the target: unchanged
    assert sampler.task_weights["math"] == pytest.approx(math_w2)
    # every drawn record belongs to a weighted task, each task in its own order
    drawn = [sampler.next() for _ in range(40)]
    assert {r.metadata["task"] for r in drawn} == {"math", "code"}


def test_curriculum_advances_at_the_threshold() -> None:
    cfg = SamplingConfig(
        curriculum=[
            CurriculumStage(name="easy", filter={"level": "easy"}, advance_at_reward=0.5),
            CurriculumStage(name="hard", filter={"level": "hard"}, advance_at_reward=0.9),
        ],
        window=2,
    )
    sampler = PromptSampler(make_records(10), cfg, "task", seed=1, shuffle=True)
    assert sampler.current_stage == "easy" and sampler.current_stage_index == 0
    assert {sampler.next().metadata["level"] for _ in range(12)} == {"easy"}
    sampler.observe({"math": [0.9]})
    assert sampler.current_stage == "easy"  # the window is not full yet
    sampler.observe({"math": [0.0, 0.2]})  # window mean (0.9 + 0.1)/2 = 0.5 reaches 0.5
    assert sampler.current_stage == "hard" and sampler.current_stage_index == 1
    assert {sampler.next().metadata["level"] for _ in range(12)} == {"hard"}
    for _ in range(5):
        sampler.observe({"math": [1.0]})
    assert sampler.current_stage == "hard"  # the last stage stays


def test_curriculum_below_threshold_stays() -> None:
    cfg = SamplingConfig(
        curriculum=[
            CurriculumStage(name="easy", filter={"level": "easy"}, advance_at_reward=0.5),
            CurriculumStage(name="hard", filter={"level": "hard"}),
        ],
        window=2,
    )
    sampler = PromptSampler(make_records(10), cfg, "task", seed=1, shuffle=True)
    sampler.observe({"math": [0.4]})
    sampler.observe({"math": [0.5]})  # (0.4 + 0.5)/2 = 0.45 < 0.5
    assert sampler.current_stage == "easy"


def test_curriculum_stage_without_records_is_an_error() -> None:
    cfg = SamplingConfig(
        curriculum=[
            CurriculumStage(name="easy", filter={"level": "easy"}, advance_at_reward=0.5),
            CurriculumStage(name="olympiad", filter={"level": "olympiad"}),
        ]
    )
    with pytest.raises(ValueError, match="'olympiad'"):
        PromptSampler(make_records(10), cfg, "task", seed=0, shuffle=True)


def test_unknown_weighted_task_is_an_error() -> None:
    cfg = SamplingConfig(tasks=TaskWeighting(weights={"math": 1.0, "poetry": 1.0}))
    with pytest.raises(ValueError, match="'poetry'"):
        PromptSampler(make_records(10), cfg, "task", seed=0, shuffle=True)


def test_tasks_the_weights_leave_out_are_named_and_a_target_must_be_weighted(caplog) -> None:
    """Rows of a task without a weight were never drawn, without a word; a target on a task that is
    not weighted did nothing."""
    records = make_records(10) + [PromptRecord(index=10, prompt="x", prompt_ids=[10], metadata={"task": "other"})]
    with caplog.at_level("WARNING"):
        sampler = PromptSampler(
            records, SamplingConfig(tasks=TaskWeighting(weights={"math": 1.0, "code": 1.0})), "task", 0, True
        )
    assert "'other' (1)" in caplog.text and "never drawn" in caplog.text
    assert 10 not in draw(sampler, 40)
    cfg = SamplingConfig(tasks=TaskWeighting(weights={"math": 1.0}, targets={"maths": 0.9}))
    with pytest.raises(ConfigError, match="targets names task 'maths'"):
        PromptSampler(make_records(10), cfg, "task", seed=0, shuffle=True)


def test_a_column_of_numbers_names_its_tasks_as_text() -> None:
    """`task: 0` rows could not be weighted: the config's names are text and the rows' values ints."""
    records = [PromptRecord(index=i, prompt=f"p{i}", prompt_ids=[i], metadata={"task": i % 2}) for i in range(10)]
    sampler = PromptSampler(
        records, SamplingConfig(tasks=TaskWeighting(weights={"0": 1.0, "1": 0.0001})), "task", 0, True
    )
    assert sum(i % 2 == 0 for i in draw(sampler, 20)) >= 18


def test_the_sampler_counts_its_draws_across_a_resume() -> None:
    sampler = PromptSampler(make_records(10), SamplingConfig(), "task", seed=0, shuffle=True)
    draw(sampler, 13)
    state = json.loads(json.dumps(sampler.state_dict()))
    resumed = PromptSampler(make_records(10), SamplingConfig(), "task", seed=0, shuffle=True)
    resumed.load_state_dict(state)
    assert sampler.draws == resumed.draws == 13
    assert draw(resumed, 5) == draw(sampler, 5) and resumed.draws == 18


def test_a_resumed_sampler_walks_over_the_groups_the_buffer_kept_and_stops_where_they_differ() -> None:
    """The groups drawn after a checkpoint survive in Redis: the restored sampler goes past the ones
    it would draw again (they go on from their tokens), and stops before a trained group, a gap or a
    prompt it would draw differently (the buffer drops those, and the sampler draws them anew)."""
    from slime.sampling import fast_forward

    def restored() -> tuple[PromptSampler, dict]:
        sampler = PromptSampler(make_records(10), SamplingConfig(), "task", seed=0, shuffle=True)
        draw(sampler, 5)
        return sampler, json.loads(json.dumps(sampler.state_dict()))

    original, checkpoint = restored()
    later = {}
    for _ in range(4):
        draw_number = original.draws + 1
        later[draw_number] = (original.next().index, "open")
    follow = draw(PromptSampler(make_records(10), SamplingConfig(), "task", seed=0, shuffle=True), 12)

    def resumed(groups: dict) -> PromptSampler:
        sampler = PromptSampler(make_records(10), SamplingConfig(), "task", seed=0, shuffle=True)
        sampler.load_state_dict(checkpoint)
        fast_forward(sampler, groups)
        return sampler

    assert resumed(later).draws == 9 and draw(resumed(later), 3) == follow[9:12]
    wrong = {**later, 8: (later[8][0] + 1, "open")}
    assert resumed(wrong).draws == 7 and draw(resumed(wrong), 1) == follow[7:8]
    assert resumed({**later, 7: (later[7][0], "trained")}).draws == 6
    assert resumed({**later, 7: (later[7][0], "dropped")}).draws == 9  # a filter's drop: walked over
    assert resumed({d: v for d, v in later.items() if d != 7}).draws == 6  # draw 7 never reached the buffer


def test_a_resumed_sampler_with_a_curriculum_does_not_walk() -> None:
    """A stage that advanced after the checkpoint draws from another pool, where the same record
    index can come up by chance: walking over it trained that prompt twice."""
    from slime.sampling import fast_forward

    cfg = SamplingConfig(curriculum=[CurriculumStage(name="easy", filter={"level": "easy"})])
    sampler = PromptSampler(make_records(10), cfg, "task", seed=0, shuffle=True)
    assert fast_forward(sampler, {1: (0, "open")}) == 0
