"""reasoning-gym's procedural datasets as environments, `reasoning-gym/<dataset>`: the question is the
user turn, the model answers in text (`<answer>...</answer>`), the dataset's own `score_answer` is
the reward, and the entry (answer, metadata) is in `info`.

Registered through the service's own entry point (pyproject.toml, group `rollout_service.envs`),
as any plugin is; listed when `reasoning_gym` is installed (`pip install ".[reasoning-gym]"`).
Listing imports nothing of it (its import takes ~2 s): the names are reasoning-gym 0.1.25's; each
dataset is built on first use, in the env worker, and kept there.

Splits never overlap: reasoning-gym derives item i of a dataset from seed + i, so the train split
takes seeds [SEED, SEED + TRAIN_SIZE) and the test split the TEST_SIZE seeds after those.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import threading
from typing import Any

from service.envs.api import RESPOND_ACTION_NAME, Action, EnvSpec, Reset, Step, UserSimConfig

PREFIX = "reasoning-gym/"
SEED = 1_000_003
TRAIN_SIZE = 100_000
TEST_SIZE = 1_000
SPLITS = {"train": (SEED, TRAIN_SIZE), "test": (SEED + TRAIN_SIZE, TEST_SIZE)}  # (first seed, size)
SYSTEM_PROMPT_NAME = "default"  # of reasoning_gym.utils.SYSTEM_PROMPTS: asks for <answer> tags
NO_TOOLS = "Error: this task has no tools. Answer in text, the final answer in <answer></answer> tags."
# `composite` mixes other datasets by a config it cannot default: not listed.
DATASETS = (
    "ab",
    "acre",
    "advanced_geometry",
    "aiw",
    "arc_1d",
    "arc_agi",
    "base_conversion",
    "basic_arithmetic",
    "bf",
    "binary_alternation",
    "binary_matrix",
    "bitwise_arithmetic",
    "boxnet",
    "caesar_cipher",
    "calendar_arithmetic",
    "chain_sum",
    "circuit_logic",
    "codeio",
    "coin_flip",
    "color_cube_rotation",
    "complex_arithmetic",
    "composite",
    "count_bits",
    "count_primes",
    "countdown",
    "course_schedule",
    "cryptarithm",
    "decimal_arithmetic",
    "decimal_chain_sum",
    "dice",
    "emoji_mystery",
    "family_relationships",
    "figlet_font",
    "fraction_simplification",
    "futoshiki",
    "game_of_life",
    "game_of_life_halting",
    "gcd",
    "graph_color",
    "group_anagrams",
    "gsm_symbolic",
    "intermediate_integration",
    "isomorphic_strings",
    "jugs",
    "kakurasu",
    "knight_swap",
    "knights_knaves",
    "largest_island",
    "lcm",
    "leg_counting",
    "letter_counting",
    "letter_jumble",
    "list_functions",
    "mahjong_puzzle",
    "manipulate_matrix",
    "maze",
    "mini_sudoku",
    "modulo_grid",
    "n_queens",
    "needle_haystack",
    "number_filtering",
    "number_format",
    "number_sequence",
    "number_sorting",
    "palindrome_generation",
    "palindrome_partitioning",
    "path_star",
    "polynomial_equations",
    "polynomial_multiplication",
    "pool_matrix",
    "power_function",
    "prime_factorization",
    "products",
    "propositional_logic",
    "puzzle24",
    "quantum_lock",
    "ransom_note",
    "rearc",
    "rectangle_count",
    "rotate_matrix",
    "rotten_oranges",
    "rubiks_cube",
    "rush_hour",
    "self_reference",
    "sentence_reordering",
    "shortest_path",
    "simple_equations",
    "simple_geometry",
    "simple_integration",
    "sokoban",
    "spell_backward",
    "spiral_matrix",
    "string_insertion",
    "string_manipulation",
    "string_splitting",
    "string_synthesis",
    "sudoku",
    "survo",
    "syllogism",
    "time_intervals",
    "tower_of_hanoi",
    "tsumego",
    "word_ladder",
    "word_sequence_reversal",
    "word_sorting",
    "zebra_puzzles",
)
UNLISTED = frozenset({"composite"})

# The env worker's threads may build datasets at once. A thread that imports a submodule while another
# is still running the package's __init__ gets a half-filled dataset registry ("not registered").
_build_lock = threading.Lock()


def installed() -> bool:
    return importlib.util.find_spec("reasoning_gym") is not None


def env_specs() -> list[EnvSpec]:
    """One env per dataset when reasoning_gym is installed; none otherwise."""
    if not installed():
        return []
    return [
        EnvSpec(
            name=f"{PREFIX}{name}",
            splits={split: size for split, (_, size) in SPLITS.items()},
            description=f"reasoning-gym's {name} dataset: one question, answered in text; "
            "reward: the dataset's score_answer.",
            factory=functools.partial(make_env, name),
            train_split="train",
        )
        for name in DATASETS
        if name not in UNLISTED
    ]


@functools.cache
def _module() -> Any:
    import reasoning_gym
    import reasoning_gym.utils

    return reasoning_gym


@functools.cache
def _dataset(name: str, split: str) -> Any:
    seed, size = SPLITS[split]
    return _module().create_dataset(name, seed=seed, size=size)


def reasoning_gym_module() -> Any:
    """reasoning_gym, whole (every dataset registered), imported once per process."""
    with _build_lock:
        return _module()


def dataset(name: str, split: str) -> Any:
    """The split's dataset object, built once per process."""
    with _build_lock:
        return _dataset(name, split)


def jsonable(value: Any) -> Any:
    """An entry's metadata as storable JSON: tuples and sets as lists, other keys and objects as
    text, non-finite numbers as text."""
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return [jsonable(item) for item in items]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, str | bool | int | float):
        return value
    return str(value)


class ReasoningGymEnv:
    """One question of a dataset. No tools: the first answer ends the episode with its score."""

    tools: list[dict[str, Any]] = []

    def __init__(self, name: str, split: str) -> None:
        self.name = name
        self.split = split
        self.dataset = dataset(name, split)
        self.system_prompt: str = reasoning_gym_module().utils.SYSTEM_PROMPTS[SYSTEM_PROMPT_NAME]
        self.entry: dict[str, Any] | None = None

    def reset(self, task_index: int) -> Reset:
        if not 0 <= task_index < len(self.dataset):
            raise IndexError(f"task_index {task_index} out of range 0..{len(self.dataset) - 1}")
        self.entry = self.dataset[task_index]
        info = {
            "dataset": self.name,
            "seed": SPLITS[self.split][0] + task_index,
            "entry": jsonable(self.entry),
        }
        return Reset(observation=str(self.entry["question"]), info=info)

    def step(self, action: Action) -> Step:
        if self.entry is None:
            raise RuntimeError("step before reset")
        if action.name != RESPOND_ACTION_NAME:
            return Step(NO_TOOLS, 0.0, False)
        answer = reasoning_gym_module().utils.extract_answer(str(action.kwargs.get("content", "")))
        score = float(self.dataset.score_answer(answer=answer, entry=self.entry))
        return Step("", score, True, {"reward_info": {"score": score, "extracted_answer": answer}})


def make_env(name: str, split: str, user_sim: UserSimConfig) -> ReasoningGymEnv:
    return ReasoningGymEnv(name, split)
