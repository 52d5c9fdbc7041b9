"""Long game prompts within `data.max_prompt_tokens` (data/games.py `TurnPrompts`): a prompt that fits is unchanged
byte for byte; a longer one leaves out its oldest history messages, as few as make it fit, and keeps the rules and
the current state; the first cut of a run is warned once; a game whose rules and current state alone exceed the
budget is refused in one line naming the key, before the first round where its opening cannot fit."""

from __future__ import annotations

import importlib.util
import logging
import random
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from grpo_lightning.app.plan import check_model_fits
from grpo_lightning.data.games import GameSeed, GameSeeds, TurnPrompts
from grpo_lightning.games import make_game
from grpo_lightning.games import registry as games_registry
from grpo_lightning.games.base import StepResult, TwoPlayerGame, bracketed_move
from grpo_lightning.rewards.pipeline import build_reward
from grpo_lightning.types import Prompt
from grpo_lightning.variants.selfplay import SelfPlay
from tests.unit.test_selfplay import REWARD, MoveEngine

HAS_TEXTARENA = importlib.util.find_spec("textarena") is not None
needs_textarena = pytest.mark.skipif(not HAS_TEXTARENA, reason="textarena is not installed (the games extra)")

TALLY_RULES = "Tally: take turns adding [1] or [2] to the total; whoever brings it to 12 wins. You are seat {seat}."


class Tally(TwoPlayerGame):
    """A project game whose observation grows with the game: its rules (first line), one line per move played (the
    history, all of it droppable), and the current state (last line)."""

    game_id = "tally"

    def reset(self, seed: int) -> None:
        self.total, self.to_move, self.moves, self._outcome = 0, 0, [], None

    @property
    def current_player(self) -> int:
        return self.to_move

    @property
    def outcome(self):
        return self._outcome

    def legal_moves(self) -> list[str]:
        return ["[1]", "[2]"]

    def lines(self, player: int) -> tuple[str, list[str], str]:
        history = [f"Move {i + 1}: seat {seat} added {n}." for i, (seat, n) in enumerate(self.moves)]
        return TALLY_RULES.format(seat=player), history, f"The total is {self.total}. Your move?"

    def observation(self, player: int) -> str:
        rules, history, state = self.lines(player)
        return "\n".join([rules, *history, state])

    def droppable_messages(self, player: int) -> int:
        return len(self.moves)

    def shortened_observation(self, player: int, dropped: int) -> str:
        rules, history, state = self.lines(player)
        return "\n".join([rules, *history[dropped:], state])

    def step(self, reply: str) -> StepResult:
        seat, move = self.to_move, bracketed_move(reply)
        if move not in self.legal_moves():
            self._outcome = (-1.0, 1.0) if seat == 0 else (1.0, -1.0)
            return StepResult(illegal=True, done=True, outcome=self._outcome)
        self.moves.append((seat, int(move[1])))
        self.total += int(move[1])
        if self.total >= 12:
            self._outcome = (1.0, -1.0) if seat == 0 else (-1.0, 1.0)
        self.to_move = 1 - seat
        return StepResult(illegal=False, done=self.done, outcome=self._outcome)


@pytest.fixture(autouse=True)
def _tally_registered(monkeypatch):
    """Tally as a built-in game for each test (data.dataset.game=tally), gone after it."""
    monkeypatch.setitem(games_registry.BUILTIN_GAMES, "tally", Tally)


def tally_after(moves: int) -> Tally:
    game = Tally()
    game.reset(0)
    for _ in range(moves):
        game.step("[1]")
    return game


def fewest_to_leave_out(prompts: TurnPrompts, game: TwoPlayerGame, player: int) -> int:
    """The truth by linear search: the fewest oldest messages whose leaving out makes the prompt fit."""
    for dropped in range(game.droppable_messages(player) + 1):
        text = game.shortened_observation(player, dropped)
        if len(prompts.source.encode(prompts.tokenizer, text)) <= prompts.max_prompt_tokens:
            return dropped
    raise AssertionError("nothing fits")


# ---- within the budget: unchanged -------------------------------------------------------------------------------


def test_prompts_within_the_budget_are_the_whole_observation_byte_for_byte(tokenizer):
    """TicTacToe's turns, a whole game: the source's encoding of the observation, as before any cut existed (the
    last 512 tokens of a prompt shorter than 512 are the prompt), and the text is the game's own."""
    src = GameSeeds(game="tictactoe")
    prompts = TurnPrompts(src, tokenizer, 512)
    game = make_game("tictactoe")
    game.reset(0)
    for cell in (4, 0, 8, 2, 1, 7, 6, 3, 5):
        player = game.current_player
        ids, dropped = prompts.encode(game, player)
        before = src.encode(tokenizer, game.observation(player))
        assert dropped == 0 and ids == before == before[-512:]
        text = tokenizer.apply_chat_template(src.messages(game.observation(player)), tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        assert tokenizer.decode(ids) == text + "["
        game.step(f"[{cell}]")
    assert game.done and not prompts.warned
    assert game.shortened_observation(0, 0) == game.observation(0) and game.droppable_messages(0) == 0


# ---- over the budget: old history leaves, rules and state stay ------------------------------------------------------


def test_a_long_prompt_leaves_out_its_oldest_history_lines_and_keeps_rules_and_state(tokenizer):
    """Tally after 10 moves, a budget 3 history lines short: by hand, the rules, moves 4 to 10 and the state."""
    src = GameSeeds(game="tally")
    game = tally_after(10)
    full = src.encode(tokenizer, game.observation(0))
    budget = len(src.encode(tokenizer, game.shortened_observation(0, 3)))
    assert budget < len(src.encode(tokenizer, game.shortened_observation(0, 2))) < len(full)
    prompts = TurnPrompts(src, tokenizer, budget)
    ids, dropped = prompts.encode(game, 0)
    assert dropped == 3 == fewest_to_leave_out(prompts, game, 0)
    expected = "\n".join([TALLY_RULES.format(seat=0), *[f"Move {i}: seat {(i - 1) % 2} added 1." for i in range(4, 11)],
                          "The total is 10. Your move?"])  # fmt: skip
    assert ids == src.encode(tokenizer, expected)
    text = tokenizer.decode(ids)
    assert "You are playing a game." in text and TALLY_RULES.format(seat=0) in text  # system prompt, rules, seat
    assert "Move 3:" not in text and "Move 4:" in text and text.endswith("The total is 10. Your move?<|im_end|>\n"
                                                                        "<|im_start|>assistant\n[")  # fmt: skip


@needs_textarena
def test_connect_four_after_twelve_moves_keeps_rules_and_state_and_drops_the_oldest_history(tokenizer):
    """TextArena's ConnectFour: 205 prompt tokens at the first move, 100 more a move (1,405 at the 13th). Player 0's
    messages after 12 moves, by hand: the rules (1), the empty board (1), and 3 a move (the move, what it did, the
    board). Its own last move is the 11th (index 2 + 3 * 10 = 32): the 32 messages before it and it are history
    (indices 1..32), the 5 after it the current state (what the move did, the board, the opponent's move, what it
    did, the board)."""
    src = GameSeeds(game="textarena:ConnectFour-v0")
    game = make_game("textarena:ConnectFour-v0")
    game.reset(0)
    rng = random.Random(0)
    for _ in range(12):
        game.step(rng.choice(game.legal_moves()))
    assert not game.done and game.current_player == 0
    full_text = game.observation(0)
    full = src.encode(tokenizer, full_text)
    assert len(full) == 1405
    assert game.droppable_messages(0) == 32
    prompts = TurnPrompts(src, tokenizer, 512)
    ids, dropped = prompts.encode(game, 0)
    assert len(ids) <= 512 and dropped == fewest_to_leave_out(prompts, game, 0)
    assert len(src.encode(tokenizer, game.shortened_observation(0, dropped - 1))) > 512  # one fewer does not fit
    text = game.shortened_observation(0, dropped)
    assert ids == src.encode(tokenizer, text)
    rules = full_text[: full_text.index("\n[GAME] Board state")]
    state = full_text[full_text.rindex("[Player 0]") :].split("\n", 1)[1]  # after its own last move
    assert "Your disc symbol: X." in rules and "For example: '[col 4]'" in rules
    assert text.startswith(rules + "\n") and text.endswith("\n" + state)
    kept = text[len(rules) :]  # the newest history messages, whole, then the state
    assert kept.startswith("\n[") and full_text.endswith(kept) and len(kept) < len(full_text) - len(rules)


@needs_textarena
@pytest.mark.parametrize(("env_id", "budget"), [("KuhnPoker-v0", 420), ("TicTacToe-v0-train", 300),
                                               ("ConnectFour-v0-raw", 420)])  # fmt: skip
def test_every_kind_of_observation_renders_its_cut_as_the_game_does(tokenizer, env_id, budget):
    """The default wrapper's, a `-train` wrapper's and the raw messages' observations: nothing left out renders the
    observation itself; each cut prompt fits, keeps the rules, and is the fewest messages left out."""
    game_id = f"textarena:{env_id}"
    src = GameSeeds(game=game_id)
    prompts = TurnPrompts(src, tokenizer, budget)
    game = make_game(game_id)
    game.reset(2)
    rng = random.Random(0)
    cuts = 0
    while not game.done:
        player = game.current_player
        observation = game.observation(player)
        assert game.shortened_observation(player, 0) == observation
        first_line = observation.split("\n", 1)[0]
        ids, dropped = prompts.encode(game, player)
        assert len(ids) <= budget and dropped == fewest_to_leave_out(prompts, game, player)
        assert first_line in tokenizer.decode(ids)
        cuts += dropped > 0
        game.step(rng.choice(game.legal_moves() or ["[check]"]))
    assert cuts > 0 or env_id == "TicTacToe-v0-train"  # the -train wrapper shows the current board, not the moves


# ---- counted and warned once ----------------------------------------------------------------------------------------


@needs_textarena
def test_the_cut_is_warned_once_however_many_cuts(tokenizer, caplog):
    src = GameSeeds(game="textarena:ConnectFour-v0")
    prompts = TurnPrompts(src, tokenizer, 512)
    game = make_game("textarena:ConnectFour-v0")
    game.reset(0)
    rng = random.Random(0)
    cuts = 0
    with caplog.at_level(logging.WARNING, logger="grpo_lightning.data.games"):
        for _ in range(20):
            cuts += prompts.encode(game, game.current_player)[1] > 0
            game.step(rng.choice(game.legal_moves()))
    assert cuts == 16  # from the 5th move on (605 tokens)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("data.max_prompt_tokens=512: prompts of textarena:ConnectFour-v0")
    assert "game/prompts_cut" in warnings[0]


def test_self_play_counts_its_cut_prompts_and_warns_once(tokenizer, caplog):
    """A round of Tally: every learner prompt the engine got fits; those that lost their first move line (not the
    opening ones, which have none) are the cut ones, counted in game/prompts_cut."""
    src = GameSeeds(game="tally")
    budget = len(src.encode(tokenizer, tally_after(4).observation(0)))  # 4 history lines fit, not 5
    v = SelfPlay(games_per_group=2, fixed_opponents=["random"])
    v.bind_data(src, tokenizer, budget)
    seen = []

    class Recording(MoveEngine):
        def generate(self, prefixes, num_samples, max_new_tokens=None, greedy=False):
            seen.extend((len(p), tokenizer.decode(p)) for p in prefixes)
            return super().generate(prefixes, num_samples, max_new_tokens, greedy)

    v.begin_round(0)
    round_prompts = [Prompt([], "", f"tally seed {s}", s, record=GameSeed("tally", s)) for s in (0, 1)]
    with caplog.at_level(logging.WARNING, logger="grpo_lightning.data.games"):
        v.generate_rollouts(Recording(tokenizer, lambda text, who: "1]"), round_prompts, build_reward(REWARD),
                            tokenizer.decode)  # fmt: skip
    assert all(length <= budget for length, _ in seen)
    cut = [t for _, t in seen if "Move " in t and "Move 1:" not in t]
    assert len(cut) > 1 and v.metrics["game/prompts_cut"] == len(cut)
    assert all(TALLY_RULES.split(" You are")[0] in t and t.endswith("Your move?<|im_end|>\n<|im_start|>assistant\n[")
               for _, t in seen)  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"data.max_prompt_tokens={budget}: prompts of tally")


# ---- refused where the rules and state alone do not fit -----------------------------------------------------------


def test_a_game_whose_rules_and_state_alone_exceed_the_budget_is_refused_in_one_line(tokenizer):
    src = GameSeeds(game="tally")
    game = tally_after(6)
    shortest = len(src.encode(tokenizer, game.shortened_observation(0, 6)))
    prompts = TurnPrompts(src, tokenizer, shortest - 1)
    with pytest.raises(ValueError, match=rf"^data\.max_prompt_tokens \({shortest - 1}\) cannot hold a prompt of tally: "
                       rf"its rules and current state alone take {shortest} tokens") as err:  # fmt: skip
        prompts.encode(game, 0)
    assert "\n" not in str(err.value)
    assert TurnPrompts(src, tokenizer, shortest).encode(game, 0)[1] == 6  # one more token: every move line left out


@needs_textarena
def test_connect_four_whose_state_outgrows_the_budget_is_refused_at_the_first_cut(tokenizer):
    """A budget that holds the opening (so the start-up check passes) but not the rules and a later state."""
    src = GameSeeds(game="textarena:ConnectFour-v0")
    game = make_game("textarena:ConnectFour-v0")
    game.reset(0)
    game.step("[3]")
    game.step("[3]")
    shortest = len(src.encode(tokenizer, game.shortened_observation(0, game.droppable_messages(0))))
    prompts = TurnPrompts(src, tokenizer, shortest - 1)
    prompts.check_opening(0)  # 205 tokens: fits
    with pytest.raises(ValueError, match=r"^data\.max_prompt_tokens \(\d+\) cannot hold a prompt of "
                                         r"textarena:ConnectFour-v0"):  # fmt: skip
        prompts.encode(game, 0)


def test_the_start_up_check_refuses_a_game_whose_opening_cannot_fit(tokenizer):
    """check_model_fits, right after the model loads and before any round: TicTacToe's opening prompts (rules and the
    empty board; seat 1's is the longer) against a budget above the chat template but below the opening."""
    src = GameSeeds(game="tictactoe")
    game = make_game("tictactoe")
    opening = max(len(src.encode(tokenizer, game.observation(seat))) for seat in (0, 1))
    datamodule = SimpleNamespace(dataset=src)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=2048))

    def cfg(data: int, eval_: int):
        evaluation = {"enabled": True, "max_new_tokens": 16, "max_prompt_tokens": eval_}
        return OmegaConf.create({"data": {"max_prompt_tokens": data}, "generator": {"max_new_tokens": 16},
                                 "eval": evaluation})  # fmt: skip

    check_model_fits(cfg(opening, opening), model, tokenizer, datamodule)  # fits exactly
    refusal = rf"^data\.max_prompt_tokens \({opening - 1}\) cannot hold a prompt of tictactoe: its rules and current "
    with pytest.raises(ValueError, match=refusal + rf"state alone take {opening} tokens"):
        check_model_fits(cfg(opening - 1, opening), model, tokenizer, datamodule)
    with pytest.raises(ValueError, match=r"^eval\.max_prompt_tokens"):
        check_model_fits(cfg(opening, opening - 1), model, tokenizer, datamodule)
