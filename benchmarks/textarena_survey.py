"""Which TextArena ids are two-player games that run offline here: the table behind games/textarena_games.py
(grpo_lightning/games/textarena_games.json).

For every id textarena registers, a subprocess (one game, that is one entry point with its variants, at a time)
blocks the network, makes the environment, resets it for two players with seed 0, reads the observation and plays
a few replies (legal moves where the game's are known, then a malformed one), first directly and then through
`TextArenaGame`; it also checks that two games with seed 0 and the same replies show the same observations.
Where two players fail it tries 1 to 6 players to say how many the game takes. A game gets 20 s per id.

    python benchmarks/textarena_survey.py                 # the markdown table: id, players, runs offline here, reason
    python benchmarks/textarena_survey.py --write         # rewrite grpo_lightning/games/textarena_games.json
    python benchmarks/textarena_survey.py --ids Nim-v0 TicTacToe-v0-raw     # a few ids only

The network is blocked by replacing the socket calls that connect or resolve a name, so the result is the same on
a machine that has network; nltk looks for its data in an empty folder, as after a fresh install.
OPENROUTER_API_KEY is removed from the subprocess's environment. Needs the games extra (`make install`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TABLE = ROOT / "grpo_lightning" / "games" / "textarena_games.json"
"""The table games/textarena_games.py reads at import."""
RESULT_PREFIX = "SURVEY-RESULT "
PER_ID_TIMEOUT_S = 20
REPLIES = ("[0]", "[1]", "[2]", "[3]", "[4]", "[5]", "hello", "[", "[]", "[99 99]")
"""Replies for games whose legal moves are unknown: cells, indices, text, broken brackets (a model's replies)."""
PLAYER_COUNTS = range(1, 7)


ATTEMPTS: list[str] = []
"""The hosts the id being probed tried to reach (cleared for each id)."""


class NetworkBlocked(OSError):
    pass


def block_network() -> None:
    """Make every connection or name lookup raise NetworkBlocked, noting the host in ATTEMPTS."""
    import socket

    def refuse(host) -> None:
        ATTEMPTS.append(str(host))
        raise NetworkBlocked(f"network blocked by the survey ({host})")

    def connect(self, address, *args):
        refuse(address[0] if isinstance(address, tuple) else address)

    socket.socket.connect = connect
    socket.socket.connect_ex = connect
    socket.create_connection = lambda address, *args, **kwargs: refuse(address[0])
    socket.getaddrinfo = lambda host, *args, **kwargs: refuse(host)
    socket.gethostbyname = refuse


def reason_for(error: BaseException | None, attempts: list[str]) -> str:
    """One short phrase for why an id does not run (it follows the id: `textarena:X <reason>`)."""
    text = f"{type(error).__name__}: {error}" if error is not None else ""
    hosts = " ".join(attempts)
    if "openrouter" in hosts.lower() or "OpenRouter" in text or "OPENROUTER" in text:
        return "calls OpenRouter"
    if "nltk" in text.lower() or "nltk" in hosts.lower() or "githubusercontent" in hosts:
        return "downloads nltk data"
    if attempts:
        return f"needs network ({attempts[0]})"
    if isinstance(error, SyntaxError) or "f-string" in text or "invalid syntax" in text:
        return "needs Python 3.12" if "f-string" in text else "has a syntax error in this textarena release"
    if "No module named 'textarena." in text:
        return "is registered but missing from the textarena wheel"
    if "No module named" in text:
        return f"needs {text.split('No module named')[-1].strip()}, which textarena does not install"
    if isinstance(error, FileNotFoundError) and "textarena" in text:
        return "misses data files in the textarena wheel"
    if "Missing required observation types" in text:
        return "breaks its -train observation wrapper (no board message)"
    if isinstance(error, TimeoutError):
        return f"takes over {PER_ID_TIMEOUT_S} s"
    return f"fails here ({text[:80]})"


def players_phrase(counts: list[int]) -> str:
    if not counts:
        return "?"
    if len(counts) == 1:
        return f"{counts[0]}+" if counts[0] == PLAYER_COUNTS[-1] else str(counts[0])
    upper = f"{counts[-1]}+" if counts[-1] == PLAYER_COUNTS[-1] else str(counts[-1])
    return f"{counts[0]}-{upper}"


def _timeout(signum, frame):
    raise TimeoutError(f"over {PER_ID_TIMEOUT_S} s")


def play_raw(env_id: str) -> None:
    """make, reset for two, observe and step the stock replies with textarena alone (its default error allowance)."""
    import textarena

    env = textarena.make(env_id)
    env.reset(num_players=2, seed=0)
    for reply in REPLIES:
        env.get_observation()
        done, _ = env.step(reply)
        if done:
            break
    env.close()


def play_wrapped(env_id: str) -> list[str]:
    """Two games through TextArenaGame: legal moves where known, else the stock replies; the observations seen."""
    from grpo_lightning.games.textarena_games import TextArenaGame

    seen = []
    game = TextArenaGame(env_id)
    for turn in range(8):
        seen.append(game.observation(game.current_player))
        seen.append(game.observation(1 - game.current_player))
        legal = game.legal_moves()
        result = game.step(legal[turn % len(legal)] if legal else REPLIES[turn % len(REPLIES)])
        if result.done:
            break
    game.reset(0)
    seen.append(game.observation(game.current_player))
    game.step("[")  # a malformed reply must be an illegal move, not an exception
    return seen


def probe(env_id: str) -> dict:
    """The survey of one id (in the subprocess)."""
    import textarena
    from textarena.envs.registration import ENV_REGISTRY

    ATTEMPTS.clear()
    attempts = ATTEMPTS
    row = {"id": env_id, "entry_point": str(ENV_REGISTRY[env_id].entry_point), "players": "?", "ok": False}
    error = None
    signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(PER_ID_TIMEOUT_S)
    try:
        counts = []
        for count in PLAYER_COUNTS:
            try:
                textarena.make(env_id).reset(num_players=count, seed=0)
                counts.append(count)
            except TimeoutError:
                raise
            except Exception as exc:  # a game fails in any way it likes
                if count == 2:
                    error = exc
        row["players"] = players_phrase(counts)
        if 2 not in counts:
            if counts == [1] and not attempts:
                row["reason"] = "is for one player"
            elif counts and min(counts) > 2 and not attempts:
                row["reason"] = "is for more than two players"
            else:
                row["reason"] = reason_for(error, attempts)
            return row
        try:
            play_raw(env_id)
            first, second = play_wrapped(env_id), play_wrapped(env_id)
        except TimeoutError:
            raise
        except Exception as exc:
            row["reason"] = reason_for(exc, attempts)
            row["trace"] = traceback.format_exc(limit=-3)
            return row
        if attempts:
            row["reason"] = reason_for(None, attempts)
            return row
        row["ok"] = True
        row["same_seed_same_game"] = first == second
        return row
    except TimeoutError as exc:
        row["reason"] = reason_for(exc, attempts)
        return row
    finally:
        signal.alarm(0)
        row["hosts"] = sorted(set(attempts))


def child(env_ids: list[str]) -> None:
    """Probe `env_ids` one after another, one result line each on the real stdout (games print on stderr)."""
    os.environ.pop("OPENROUTER_API_KEY", None)
    out = sys.stdout
    sys.stdout = sys.stderr
    block_network()
    with tempfile.TemporaryDirectory(prefix="survey-nltk-") as nltk_data:
        os.environ["NLTK_DATA"] = nltk_data
        try:
            import nltk

            nltk.data.path[:] = [nltk_data]
        except ImportError:
            pass
        for env_id in env_ids:
            try:
                row = probe(env_id)
            except Exception as exc:  # an import that fails at the registry, say
                row = {"id": env_id, "players": "?", "ok": False, "reason": reason_for(exc, [])}
            out.write(RESULT_PREFIX + json.dumps(row) + "\n")
            out.flush()


def run_group(env_ids: list[str], verbose: bool) -> dict[str, dict]:
    """One subprocess for a game's ids; ids it did not report (it died or hung) are rerun one per subprocess."""
    rows: dict[str, dict] = {}
    command = [sys.executable, __file__, "--child", *env_ids]
    timeout = PER_ID_TIMEOUT_S * (len(PLAYER_COUNTS) + 1) * len(env_ids) + 30
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        stdout, stderr = done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        stdout, stderr = exc.stdout or "", exc.stderr or ""
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            row = json.loads(line[len(RESULT_PREFIX) :])
            rows[row["id"]] = row
    missing = [env_id for env_id in env_ids if env_id not in rows]
    if missing and len(env_ids) == 1:
        tail = (stderr or "").strip().splitlines()[-1:] or ["no output"]
        rows[env_ids[0]] = {"id": env_ids[0], "players": "?", "ok": False, "reason": f"crashes here ({tail[0][:80]})"}
    elif missing:
        for env_id in missing:
            rows.update(run_group([env_id], verbose))
    if verbose:
        for env_id in env_ids:
            print(env_id, rows[env_id].get("reason", "ok"), file=sys.stderr, flush=True)
    return rows


def survey(env_ids: list[str] | None, verbose: bool) -> list[dict]:
    from textarena.envs.registration import ENV_REGISTRY

    groups: dict[str, list[str]] = defaultdict(list)
    for env_id in env_ids or sorted(ENV_REGISTRY):
        if env_id not in ENV_REGISTRY:
            raise SystemExit(f"{env_id} is not a registered TextArena id")
        groups[str(ENV_REGISTRY[env_id].entry_point)].append(env_id)
    rows: dict[str, dict] = {}
    for ids in groups.values():
        rows.update(run_group(ids, verbose))
    return [rows[env_id] for env_id in sorted(rows, key=str.lower)]


def markdown(rows: list[dict]) -> str:
    lines = ["| id | players | runs offline here | reason |", "|---|---|---|---|"]
    for row in rows:
        ok = "yes" if row["ok"] else "no"
        if row["ok"] and not row.get("same_seed_same_game", True):
            ok = "yes (seed 0 twice differed)"
        lines.append(f"| {row['id']} | {row['players']} | {ok} | {row.get('reason', '')} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> dict:
    """The table of games/textarena_games.py: the release and the Python surveyed, the ids that run here (in the
    survey's order) and, for every other id, why it does not."""
    import textarena

    return {
        "generated_by": "python benchmarks/textarena_survey.py --write (do not edit by hand)",
        "textarena": textarena.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "offline_two_player": [row["id"] for row in rows if row["ok"]],
        "not_here": {row["id"]: row["reason"] for row in rows if not row["ok"]},
    }


def table_text(rows: list[dict]) -> str:
    """The table as the file holds it: JSON, one id a line."""
    return json.dumps(table(rows), indent=1) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ids", nargs="+", help="survey these ids only")
    parser.add_argument("--write", action="store_true", help="survey every id and write the table to games/")
    parser.add_argument("--json", type=Path, help="also write every row (with tracebacks) to this file")
    parser.add_argument("--verbose", action="store_true", help="one line per id on stderr as it goes")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    if args.write and args.ids:
        parser.error("--write surveys every id: leave out --ids")
    rows = survey(args.ids, args.verbose)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.write:
        TABLE.write_text(table_text(rows), encoding="utf-8")
        print(f"wrote {TABLE.relative_to(ROOT)}")
    else:
        print(markdown(rows))


if __name__ == "__main__":
    main()
