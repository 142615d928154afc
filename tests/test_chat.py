"""`posttrain chat`: piped stdin through typer's CliRunner, on a tiny model and on SmolLM2 (one turn)."""

from __future__ import annotations

import pytest
from rich.console import Console
from typer.testing import CliRunner

from posttrain.chat import chat_loop, open_session
from posttrain.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()


def _chat(args: list[str], stdin: str):
    return runner.invoke(app, ["chat", *args], input=stdin, env={"COLUMNS": "200"})


def test_tiny_model_multi_turn_reset_and_exit(policy_dir):
    result = _chat([str(policy_dir), "--temperature", "0", "--max-new-tokens", "6"],
                   "What is 2 + 3?\n\n/reset\nWhat is 4 + 4?\n/exit\nnever read\n")
    assert result.exit_code == 0, result.output
    assert result.output.count("model>") == 2            # the blank line is skipped; nothing after /exit runs
    assert "(conversation reset)" in result.output
    assert "cut at 6 tokens" in result.output             # a random model never ends its turn within 6


def test_history_is_rendered_with_the_template_and_reset_clears_it(policy_dir):
    session = open_session(policy_dir, system="Be brief.", temperature=0.0, max_new_tokens=4)
    first = session.send("What is 2 + 3?")
    assert [m["role"] for m in session.messages()] == ["system", "user", "assistant"]
    ids, dropped = session.prompt_ids()
    text = session.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and dropped == 0
    assert first.text in text and text.endswith("<|im_start|>assistant\n")
    session.send("And 4 + 4?")
    assert len(session.history) == 4
    session.reset()
    assert session.messages() == [{"role": "system", "content": "Be brief."}]


def test_oldest_turns_are_dropped_to_fit_the_context(policy_dir):
    session = open_session(policy_dir, temperature=0.0, max_new_tokens=4)
    limit = session.model.config.max_position_embeddings          # 160 for the tiny-1m fixture
    session.history = [{"role": r, "content": "1 2 3 4 5 6 7 8 9 " * 3} for r in ("user", "assistant") * 6]
    session.history.append({"role": "user", "content": "and now?"})
    ids, dropped = session.prompt_ids()
    assert dropped > 0 and dropped % 2 == 0 and len(ids) + 4 <= limit
    assert session.history[-1]["content"] == "and now?"


def test_end_of_input_ends_the_session(policy_dir):
    session = open_session(policy_dir, temperature=0.0, max_new_tokens=3)
    lines = iter(["hello", "/unknown"])

    def read() -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    console = Console(record=True, width=200)
    assert chat_loop(session, console, read) == 1
    assert "unknown command /unknown" in console.export_text()


def test_not_a_model_folder_is_one_line_exit_2(tmp_path):
    result = _chat([str(tmp_path)], "hi\n")
    assert result.exit_code == 2 and "not a Hugging Face model folder" in result.output
    assert _chat([str(tmp_path), "--temperature", "-1"], "").exit_code == 2


def test_smollm2_one_turn(smollm2):
    result = _chat([str(smollm2), "--temperature", "0", "--max-new-tokens", "24"], "What is the capital of France?\n")
    assert result.exit_code == 0, result.output
    reply = result.output.split("model>", 1)[1]
    assert "Paris" in reply, result.output
