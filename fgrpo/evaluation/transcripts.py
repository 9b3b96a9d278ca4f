"""An environment's episodes as a user reads them: at each evaluation, one episode of each of the first few held-out
problems per set, written to ``transcripts.jsonl`` (a row per episode: step, set, problem, the conversation, its
turns, tool calls, reward and verdict) and as ``transcripts/step_<N>.md``, the conversation turn by turn."""

from __future__ import annotations

import json
import os
from pathlib import Path

TRANSCRIPTS_FILE = "transcripts.jsonl"
TRANSCRIPTS_DIR = "transcripts"
TRANSCRIPTS_KEY = "eval/transcripts"  # the W&B table's key


TABLE_COLUMNS = ["dataset", "problem", "conversation", "turns", "tool_calls", "reward", "correct"]


def table_rows(rows: list[dict]) -> list[list]:
    """The rows as W&B's transcript table holds them (:data:`TABLE_COLUMNS`): the conversation as one text."""
    return [[row["dataset"], row["problem"], "\n\n".join(f"{m['role']}: {m['content']}" for m in row["messages"]),
             row["turns"], row["tool_calls"], row["reward"], row["correct"]] for row in rows]


def transcript_rows(step: int, transcripts: dict[str, list]) -> list[dict]:
    """One row per episode: ``transcripts`` maps a set's name to ``[(problem id, EpisodeRecord)]``."""
    return [{"step": step, "dataset": name, "problem": problem, "messages": record.messages, "turns": record.turns,
             "tool_calls": record.tool_calls, "tool_errors": record.tool_errors, "truncated": record.truncated,
             "env_reward": record.env_reward, "reward": record.reward, "correct": record.correct,
             "failure": record.failure}
            for name, episodes in transcripts.items() for problem, record in episodes]


def write_transcripts(run_dir: Path, step: int, transcripts: dict[str, list]) -> list[dict]:
    """Append this evaluation's episodes to ``transcripts.jsonl`` (flushed) and write ``transcripts/step_<N>.md``;
    returns the rows."""
    rows = transcript_rows(step, transcripts)
    with open(Path(run_dir) / TRANSCRIPTS_FILE, "a", encoding="utf-8") as file:
        file.writelines(json.dumps(row, default=str) + "\n" for row in rows)
        file.flush()
        os.fsync(file.fileno())
    folder = Path(run_dir) / TRANSCRIPTS_DIR
    folder.mkdir(exist_ok=True)
    (folder / f"step_{step:04d}.md").write_text(markdown(step, rows), encoding="utf-8")
    return rows


def markdown(step: int, rows: list[dict]) -> str:
    """The episodes of one evaluation, each a heading and its turns."""
    parts = [f"# Episodes at step {step}\n"]
    for row in rows:
        verdict = {True: "right", False: "wrong", None: "no verdict"}[row["correct"]]
        ending = f", failed ({row['failure']})" if row["failure"] else ", truncated" if row["truncated"] else ""
        parts.append(f"## {row['dataset']} / {row['problem']}: {row['turns']} turns, {row['tool_calls']} tool calls, "
                     f"reward {row['reward']:g}, {verdict}{ending}\n")
        for message in row["messages"]:
            parts.append(f"**{message['role']}**: {message['content']}\n")
    return "\n".join(parts)
