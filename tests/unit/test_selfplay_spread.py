"""The levers that keep self-play's spread, against independent truths: the seeded order of `tictactoe_shuffled`'s
legal-move list (a permutation, reproducible, varying) beside the default prompt written out by hand; the perfect
player uniform over the optimal moves of a brute-force minimax written here; the noisy scripted players' exact
distributions and sampled frequencies (within 5 binomial standard deviations); the groups-alike share and the move
entropy on hand-built results, and on a played round recomputed from its rollouts."""

from __future__ import annotations

import math
import random
import re
from collections import Counter

import pytest

from grpo_lightning.data.games import GameSeed, GameSeeds
from grpo_lightning.games import check_game_id, make_game
from grpo_lightning.games.exact import both_seats
from grpo_lightning.games.play import (
    NoisyPlayer,
    PerfectPlayer,
    RandomMovePlayer,
    TacticPlayer,
    groups_alike,
    move_entropy,
)
from grpo_lightning.games.tictactoe import shuffled_moves
from grpo_lightning.rewards.pipeline import build_reward
from grpo_lightning.types import Prompt
from grpo_lightning.variants.selfplay import SelfPlay
from tests.unit.test_selfplay import REWARD, MoveEngine, lowest_legal, prompts, variant

LEGAL = re.compile(r"Legal moves: (.*)\n")
EXAMPLE = re.compile(r"for example (\S+)\.$")


def game_after(game_id: str, seed: int, moves: list[str]):
    game = make_game(game_id)
    game.reset(seed)
    for move in moves:
        game.step(move)
    return game


def within_binomial(count: int, n: int, p: float, sds: float = 5.0) -> bool:
    return abs(count - n * p) <= sds * math.sqrt(n * p * (1 - p))


# ---- the default prompt ----------------------------------------------------------------------------------------
OPENING_X = """You are playing Tic Tac Toe as X (you move first). Get three of your marks in a row, column or \
diagonal to win. Numbers are free cells.

 0 | 1 | 2
---+---+---
 3 | 4 | 5
---+---+---
 6 | 7 | 8

Legal moves: [0], [1], [2], [3], [4], [5], [6], [7], [8]
Reply with your move as a cell number in square brackets, for example [4]."""

AFTER_4_0_X = """You are playing Tic Tac Toe as X (you move first). Get three of your marks in a row, column or \
diagonal to win. Numbers are free cells.

 O | 1 | 2
---+---+---
 3 | X | 5
---+---+---
 6 | 7 | 8

Legal moves: [1], [2], [3], [5], [6], [7], [8]
Reply with your move as a cell number in square brackets, for example [4]."""


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_the_default_prompt_is_the_one_written_out_by_hand(seed):
    assert game_after("tictactoe", seed, []).observation(0) == OPENING_X
    assert game_after("tictactoe", seed, ["[4]", "[0]"]).observation(0) == AFTER_4_0_X


# ---- the shuffled order ----------------------------------------------------------------------------------------
def random_positions(game_id: str, count: int, seed: int = 0):
    """(game seed, moves) of `count` positions along random games, each position's game still going."""
    rng, found = random.Random(seed), []
    while len(found) < count:
        game_seed, game, moves = rng.randrange(10**6), make_game(game_id), []
        game.reset(game_seed)
        while not game.done and len(found) < count:
            found.append((game_seed, list(moves)))
            move = rng.choice(game.legal_moves())
            moves.append(move)
            game.step(move)
    return found


def test_the_shuffled_list_is_a_permutation_of_the_legal_moves_and_the_rules_are_tictactoes():
    assert check_game_id("tictactoe_shuffled") is None
    for seed, moves in random_positions("tictactoe_shuffled", 300):
        plain, shuffled = game_after("tictactoe", seed, moves), game_after("tictactoe_shuffled", seed, moves)
        for player in (0, 1):
            listed = LEGAL.search(shuffled.observation(player)).group(1).split(", ")
            assert sorted(listed) == sorted(plain.legal_moves()) and len(set(listed)) == len(listed)
            assert EXAMPLE.search(shuffled.observation(player)).group(1) in listed
            # everything but the list and the example is the default prompt's
            strip = lambda text: EXAMPLE.sub("", LEGAL.sub("", text))  # noqa: E731
            assert strip(shuffled.observation(player)) == strip(plain.observation(player))
        assert shuffled.legal_moves() == plain.legal_moves()  # ascending: the scripted players draw alike
        assert shuffled.optimal_moves() == plain.optimal_moves()


def test_the_order_is_the_same_for_the_same_seed_and_turn_in_a_fresh_game():
    for seed, moves in random_positions("tictactoe_shuffled", 100, seed=1):
        a, b = game_after("tictactoe_shuffled", seed, moves), game_after("tictactoe_shuffled", seed, moves)
        random.seed(99)  # the global random state plays no part
        first = a.observation(0)
        random.seed(7)
        assert first == b.observation(0) == a.observation(0)


def test_the_order_and_the_example_vary_across_seeds_and_turns():
    openings = [game_after("tictactoe_shuffled", seed, []).observation(0) for seed in range(50)]
    orders = {LEGAL.search(o).group(1) for o in openings}
    assert len(orders) >= 45  # 9! orders: 50 seeds collide rarely
    examples = Counter(EXAMPLE.search(o).group(1) for o in openings)
    assert len(examples) >= 6 and examples["[4]"] < 25  # no fixed cell
    cells = [f"[{i}]" for i in range(9)]
    by_turn = {tuple(shuffled_moves(cells, 3, turn)[0]) for turn in range(9)}
    assert len(by_turn) == 9  # the same moves, another order at another turn
    assert all(sorted(order) == cells for order in by_turn)


# ---- the perfect player ----------------------------------------------------------------------------------------
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))


def brute_value(board: list[str], me: str) -> int:
    """Negamax over the whole tree, no memo: +1 if `me`, to move, wins under perfect play, 0 draw, -1 loss."""
    other = "O" if me == "X" else "X"
    if any(board[a] == board[b] == board[c] == other for a, b, c in LINES):
        return -1
    free = [i for i, c in enumerate(board) if c == "."]
    if not free:
        return 0
    best = -2
    for cell in free:
        board[cell] = me
        best = max(best, -brute_value(board, other))
        board[cell] = "."
    return best


def brute_optimal(moves: list[str]) -> set[str]:
    board, me = ["."] * 9, "X"
    for move in moves:
        board[int(move[1])] = me
        me = "O" if me == "X" else "X"
    values = {}
    for cell in [i for i, c in enumerate(board) if c == "."]:
        board[cell] = me
        values[f"[{cell}]"] = -brute_value(board, "O" if me == "X" else "X")
        board[cell] = "."
    best = max(values.values())
    return {move for move, v in values.items() if v == best}


def test_the_perfect_player_is_uniform_over_the_optimal_moves():
    moves = ["[4]"]  # O to move after X took the centre: the corners draw, the edges lose
    optimal = brute_optimal(moves)
    assert optimal == {"[0]", "[2]", "[6]", "[8]"}
    game, player, n = game_after("tictactoe", 0, moves), PerfectPlayer(), 4000
    counts = Counter(player.choose(game, random.Random(seed)) for seed in range(n))
    assert set(counts) == optimal  # each optimal move, never another
    assert all(within_binomial(counts[m], n, 1 / len(optimal)) for m in optimal), counts
    for moves in (["[0]"], ["[1]"], ["[0]", "[4]"], ["[4]", "[0]", "[8]"]):  # more positions, the same rule
        game, optimal = game_after("tictactoe", 0, moves), brute_optimal(moves)
        assert set(game.optimal_moves()) == optimal
        assert player.move_distribution(game) == pytest.approx(dict.fromkeys(optimal, 1 / len(optimal)))


# ---- the noisy scripted players --------------------------------------------------------------------------------
@pytest.mark.parametrize("inner", [PerfectPlayer, TacticPlayer])
def test_epsilon_0_is_the_old_player_draw_for_draw(inner):
    for game_seed, moves in random_positions("tictactoe", 200, seed=2):
        game = game_after("tictactoe", game_seed, moves)
        noisy, plain = NoisyPlayer(inner(), 0.0), inner()
        assert noisy.name == plain.name and noisy.move_distribution(game) == plain.move_distribution(game)
        a, b = random.Random(game_seed), random.Random(game_seed)
        assert [noisy.choose(game, a) for _ in range(5)] == [plain.choose(game, b) for _ in range(5)]
        assert a.random() == b.random()  # and the generators are left alike


@pytest.mark.parametrize("inner", [PerfectPlayer, TacticPlayer])
def test_epsilon_1_is_uniform_over_the_legal_moves(inner):
    game, n = game_after("tictactoe", 0, ["[4]"]), 8000
    noisy = NoisyPlayer(inner(), 1.0)
    assert noisy.move_distribution(game) == pytest.approx(RandomMovePlayer().move_distribution(game))
    rng = random.Random(5)
    counts = Counter(noisy.choose(game, rng) for _ in range(n))
    assert set(counts) == set(game.legal_moves())
    assert all(within_binomial(counts[m], n, 1 / 8) for m in game.legal_moves()), counts


def test_an_epsilon_between_mixes_by_hand():
    """After X's centre the perfect O plays a corner: each corner 0.7 / 4 + 0.3 / 8 = 0.2125, each edge 0.3 / 8."""
    game, n = game_after("tictactoe", 0, ["[4]"]), 8000
    noisy = NoisyPlayer(PerfectPlayer(), 0.3)
    expected = {f"[{c}]": (0.2125 if c in (0, 2, 6, 8) else 0.0375) for c in (0, 1, 2, 3, 5, 6, 7, 8)}
    assert noisy.move_distribution(game) == pytest.approx(expected)
    rng = random.Random(11)
    counts = Counter(noisy.choose(game, rng) for _ in range(n))
    assert all(within_binomial(counts[m], n, p) for m, p in expected.items()), counts


def test_the_noisy_players_exact_values_meet_the_tables_at_epsilon_0_and_1():
    """docs/selfplay.md's table against `random`, both seats averaged: `perfect` 0.873 / 0.127 / 0.000, `tactic`
    0.798 / 0.165 / 0.037, `random` 0.437 / 0.127 / 0.437 (what either becomes at epsilon 1)."""
    table = {(PerfectPlayer, 0.0): (0.873, 0.127, 0.0), (TacticPlayer, 0.0): (0.798, 0.165, 0.037),
             (PerfectPlayer, 1.0): (0.437, 0.127, 0.437), (TacticPlayer, 1.0): (0.437, 0.127, 0.437)}  # fmt: skip
    for (inner, epsilon), (win, draw, loss) in table.items():
        mean = both_seats(lambda: make_game("tictactoe"), NoisyPlayer(inner(), epsilon), RandomMovePlayer())[2]
        assert (mean.win, mean.draw, mean.loss) == pytest.approx((win, draw, loss), abs=5e-4)


def test_scripted_epsilon_is_checked_in_one_line_and_reaches_only_perfect_and_tactic(tokenizer):
    with pytest.raises(ValueError) as err:
        SelfPlay(scripted_epsilon=1.5)
    assert str(err.value) == "variant.scripted_epsilon must be <= 1.0 (got 1.5)"
    with pytest.raises(ValueError, match=r"^variant.scripted_epsilon must be a finite number \(got 'x'\)$"):
        SelfPlay(scripted_epsilon="x")
    with pytest.raises(ValueError, match="epsilon must be in"):
        NoisyPlayer(PerfectPlayer(), -0.1)
    plain, noisy = SelfPlay(), SelfPlay(scripted_epsilon=0.25)
    assert type(plain.player("perfect", None)) is PerfectPlayer and type(plain.player("tactic", None)) is TacticPlayer
    for name in ("perfect", "tactic"):
        made = noisy.player(name, None)
        assert isinstance(made, NoisyPlayer) and made.name == name and made.epsilon == 0.25
    assert type(noisy.player("random", None)) is RandomMovePlayer


# ---- spread metrics --------------------------------------------------------------------------------------------
def test_groups_alike_by_hand():
    results = [(0, 1.0), (0, 1.0), (0, 1.0), (1, 1.0), (1, -1.0), (2, 0.0), (3, -1.0), (3, -1.0), (3, 0.0)]
    assert groups_alike(results) == (2, 4)  # groups 0 (all won) and 2 (one game); 1 and 3 differ
    assert groups_alike([]) == (0, 0)


def test_move_entropy_by_hand():
    moves = [("a", "[0]"), ("a", "[0]"), ("a", "[1]"), ("a", "[1]"),  # ln 2 over 4 turns
             ("b", "[4]"), ("b", "[4]"), ("b", "[4]"),  # 0 over 3
             ("c", "[2]"),  # met once: not counted
             ("d", "[5]"), ("d", None)]  # fmt: skip  # no move is an outcome: ln 2 over 2
    entropy, turns = move_entropy(moves)
    assert turns == 9
    assert entropy == pytest.approx((4 * math.log(2) + 2 * math.log(2)) / 9)
    assert move_entropy([("x", "[0]")]) == (0.0, 0)
    third = [("p", f"[{i}]") for i in range(3)]
    assert move_entropy(third) == (pytest.approx(math.log(3)), 3)


def test_a_rounds_spread_metrics_are_its_rollouts(tokenizer):
    """A learner that plays a seeded random legal move against the random player: the groups-alike share and the
    move entropy recomputed from the rollouts (their group, outcome term, prompt and move)."""
    rng = random.Random(0)

    def random_legal(text: str, who: str) -> str:
        return rng.choice(LEGAL.findall(text)[-1].split(", "))[1:]

    v = variant(tokenizer, games_per_group=4)
    v.begin_round(0)
    rollouts = v.generate_rollouts(MoveEngine(tokenizer, random_legal), prompts(list(range(8))), build_reward(REWARD),
                                   lambda ids: tokenizer.decode(ids, skip_special_tokens=True))  # fmt: skip
    outcomes: dict[int, set[float]] = {}
    for r in rollouts:
        outcomes.setdefault(r.group_id, set()).add(r.reward_terms["outcome"])
    alike = sum(len(s) == 1 for s in outcomes.values())
    assert v.metrics["game/groups_alike_frac"] == alike / 8 < 1.0
    by_prompt: dict[tuple, Counter] = {}
    for r in rollouts:
        by_prompt.setdefault(tuple(r.prompt_ids), Counter())[r.text] += 1
    repeated = [c for c in by_prompt.values() if sum(c.values()) > 1]
    turns = sum(sum(c.values()) for c in repeated)
    total = sum(-sum(k * math.log(k / sum(c.values())) for k in c.values()) for c in repeated)
    assert v.metrics["game/move_entropy_turns"] == turns > 0
    assert v.metrics["game/move_entropy"] == pytest.approx(total / turns) and total > 0


def seat_0_openings(tokenizer, game_id: str, seeds: list[int]) -> dict[int, set[str]]:
    """Per group where the learner moved first: the opening moves of its games, the learner copying the list."""
    v = SelfPlay(games_per_group=3, fixed_opponents=["random"], opponent_sampling="random")
    v.bind_data(GameSeeds(game=game_id), tokenizer, 512)
    played, rollouts_of = [], v.rollouts_of
    v.rollouts_of = lambda matches, *rest: played.extend(matches) or rollouts_of(matches, *rest)
    v.begin_round(0)
    batch = [Prompt([], "", f"{game_id} seed {s}", s, record=GameSeed(game_id, s)) for s in seeds]
    v.generate_rollouts(MoveEngine(tokenizer, lowest_legal), batch, build_reward(REWARD),
                        lambda ids: tokenizer.decode(ids, skip_special_tokens=True))  # fmt: skip
    openings: dict[int, set[str]] = {}
    for m in played:
        if m.learner_seat == 0:
            openings.setdefault(m.group_id, set()).add(m.turns[0].move)
    return openings


def test_a_shuffled_round_shares_the_order_within_a_group_and_not_across_groups(tokenizer):
    """A learner that copies the list's first entry: in `tictactoe` it opens on [0] in every game; in
    `tictactoe_shuffled` the games of a group (one seed) open alike, and the groups (other seeds) do not."""
    plain = seat_0_openings(tokenizer, "tictactoe", list(range(12)))
    assert plain and all(o == {"[0]"} for o in plain.values())
    shuffled = seat_0_openings(tokenizer, "tictactoe_shuffled", list(range(12)))
    assert all(len(o) == 1 for o in shuffled.values())
    assert len(set().union(*shuffled.values())) >= 2
