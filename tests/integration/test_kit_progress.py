"""A kit model's first-use build says what it is doing and how far it is, as it goes: the SFT steps
of a cold start (the tiny model's and the teacher's code) and the judge's sampling of the policy, in
log lines whose counts rise to the total."""

import logging
import re
from dataclasses import replace

from shared.kit.build_progress import BuildProgress
from shared.kit.tiny import TinySpec, char_tokenizer, init_tiny_model

LINE = re.compile(r"building (.+?): (.+?) (\d+)/(\d+)(?:, (.*))?, (\d+) s$")


def progress_lines(caplog) -> list[tuple[str, str, int, int, str]]:
    """(what, phase, done, total, note) of each progress line logged."""
    found = []
    for record in caplog.records:
        match = LINE.match(record.getMessage()) if record.name == "steadyrl.kit" else None
        if match:
            what, phase, done, total, note, _ = match.groups()
            found.append((what, phase, int(done), int(total), note or ""))
    return found


def test_a_first_use_build_shows_its_steps_rising_to_the_end(tmp_path, caplog):
    spec = replace(TinySpec(), sft_max_steps=12, sft_eval_every=4, sft_eval_size=16, target_accuracy=1.01)
    with caplog.at_level(logging.INFO, logger="steadyrl.kit"):
        init_tiny_model(spec=spec, seed=5, cache_dir=tmp_path / "cache")
    lines = progress_lines(caplog)
    assert {(what, phase, total) for what, phase, _, total, _ in lines} == {
        ("the kit's tiny model (arith, seed 5)", "SFT step", 12)
    }
    steps = [done for _, _, done, _, _ in lines]
    assert steps == sorted(steps) and {0, 4, 8, 12} <= set(steps), steps  # each eval is shown, and the start
    measured = r"(loss [\d.]+, )?greedy accuracy [\d.]+ \(stops at 1.01\)"  # the last eval's figures
    assert all(re.fullmatch(measured, note) for *_, note in lines), lines
    assert lines[-1][2] == 12 and lines[-1][4].startswith("loss ")  # the last eval, after the last step
    built = [r.getMessage() for r in caplog.records if r.getMessage().startswith("built the kit's tiny model")]
    assert len(built) == 1 and "12 SFT steps" in built[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="steadyrl.kit"):  # cached: built once, nothing to show
        init_tiny_model(spec=spec, seed=5, cache_dir=tmp_path / "cache")
    assert not progress_lines(caplog)


def test_the_judge_s_sampling_of_the_policy_shows_the_problems_answered(tiny_model_dir, caplog):
    from shared.kit.tiny_judge import policy_answers

    examples = TinySpec().task(0).split("train", 1200)
    with caplog.at_level(logging.INFO, logger="steadyrl.kit"):
        answers = policy_answers(char_tokenizer(), examples, 1, 0, BuildProgress("a judge", every_seconds=0))
    assert len(answers) == 1200 and all(len(a) == 1 for a in answers)
    lines = progress_lines(caplog)
    assert [(done, total) for _, _, done, total, _ in lines] == [(0, 1200), (500, 1200), (1000, 1200), (1200, 1200)]
    assert all(what == "a judge" and "sampling the tiny policy's answers" in phase for what, phase, *_ in lines)
