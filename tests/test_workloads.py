"""`specserve bench --workload`: the traffic workloads' texts (app.bench.workloads) and their
runner (app.bench.traffic).

The runner runs on a tiny random target with the real tokenizer and chat template (a synthetic GGUF, as
test_bench's), so prompts are rendered and counted as the server would, in seconds. Speeds on a shared machine
say nothing here: the tests check determinism, the prompts' sizes, what each turn feeds back, that every
configuration runs every turn with target-only's greedy output, and the tenants.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from app.bench import synthetic, traffic, workloads
from app.cli import build_parser, main
from app.cli.bench import workload_names
from app.engine import factory

TINY = synthetic.Shape("tiny", n_layers=2, dim=64, intermediate=128, n_heads=2, n_kv_heads=1, head_dim=32)
# "Under about 1,500 tokens": the agent's longest history, with every answer as long as allowed, is 1,505.
PROMPT_LIMIT = 1536


@pytest.fixture(scope="module")
def tiny_gguf(target_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random target with SmolLM2's tokenizer and chat template, as a GGUF llama.cpp reads too."""
    return synthetic.write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.q8_0.gguf", TINY, "q8_0", target_path)


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Path):
    """(engine, loaded) on the tiny target; lookup drafts only."""
    return factory.build_engine(str(tiny_gguf), "ngram", weights="native")


def _turns(episode: workloads.Episode, answers: list[str]) -> list[list[dict]]:
    """Every turn's messages, the answers fed back one by one."""
    return [episode.messages(answers[:t]) for t in range(episode.turns)]


def test_workloads_are_deterministic_per_seed() -> None:
    """The same seed gives the same episodes, turn by turn (answers fed back included); another seed changes the
    seeded texts; each workload has the shape the bench promises."""
    answers = [f"answer {i}" for i in range(20)]
    for name in workloads.WORKLOADS:
        first, again, other = (workloads.episodes(name, seed) for seed in (0, 0, 1))
        assert [_turns(e, answers) for e in first] == [_turns(e, answers) for e in again], name
        assert [_turns(e, answers) for e in first] != [_turns(e, answers) for e in other], name
        assert all(e.workload == name for e in first) and [e.index for e in first] == list(range(len(first)))
    limited, whole = workloads.episodes("chat", limit=2), workloads.episodes("chat")
    assert [_turns(e, answers) for e in limited] == [_turns(e, answers) for e in whole[:2]] and len(whole) > 2
    assert all(e.turns >= 11 and e.tools == workloads.AGENT_TOOLS for e in workloads.episodes("agent"))
    assert all(e.turns >= 5 for e in workloads.episodes("chat"))
    assert len(workloads.episodes("extraction")) >= 8
    for e in workloads.episodes("code-edit"):
        assert e.prediction and e.prediction in e.messages([])[0]["content"]
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.episodes("nope")
    with pytest.raises(ValueError, match="has 1 turns"):
        workloads.episodes("rag")[0].messages(["one answer"])


def test_chat_feeds_back_every_answer() -> None:
    episode = workloads.episodes("chat")[0]
    messages = episode.messages(["first answer", "second answer"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in messages if m["role"] == "assistant"] == ["first answer", "second answer"]
    assert messages[:3] == episode.messages(["first answer"])[:3]  # the history only grows


def test_agent_feeds_back_each_call_result(tiny) -> None:
    """A call the model wrote is the history's call, answered by its tool's result; an answer without one gets
    the plan's call; rendered, the tools sit in the system message in the Hermes format, results in
    `<tool_response>` turns."""
    episode = workloads.episodes("agent")[0]
    call = {"name": "read_file", "arguments": {"path": "app/cli.py", "start": 3}}
    own = f"Let me look.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
    messages = episode.messages([own, "I am not sure what to do."])
    assistant, result = messages[2], messages[3]
    assert assistant["content"] == "Let me look."
    assert assistant["tool_calls"][0]["function"] == {"name": "read_file", "arguments": json.dumps(call["arguments"])}
    assert result == {
        "role": "tool",
        "tool_call_id": assistant["tool_calls"][0]["id"],
        "content": workloads.tool_result("read_file", call["arguments"]),
    }
    planned = messages[4]["tool_calls"][0]["function"]
    assert messages[4]["content"] is None and planned["name"] == "search_docs"  # the plan's second call
    assert json.loads(messages[5]["content"])["results"]
    text = traffic.render_chat(tiny[1].tokenizer, messages, episode.tools)
    system = text.split("<|im_end|>")[0]
    assert text.count("<tool_response>") == 2 and '"name": "run_tests"' in system and "<tool_call>" in system
    assert text.endswith("<|im_start|>assistant\n")


def test_agent_and_chat_feed_back_the_messages_a_server_sent() -> None:
    """Over HTTP (`specserve loadtest`) an answer is the assistant message the server streamed: its first call
    to one of the tools (arguments a JSON object) is the history's call, with the harness's id, not the server's
    random one, so a turn's prompt is the same in every run; a message whose calls are not valid, and whose text
    holds none either, gets the plan's call; chat feeds back the message's content."""
    episode = workloads.episodes("agent")[1]
    arguments = {"path": "app/api/tools.py", "start": 3}

    def sent(*calls: dict) -> dict:
        return {"role": "assistant", "content": "Looking.", "tool_calls": [dict(c, type="function") for c in calls]}

    unknown = {"id": "call_a", "function": {"name": "rm_rf", "arguments": "{}"}}
    good = {"id": "call_random", "function": {"name": "read_file", "arguments": json.dumps(arguments)}}
    broken = {"id": "call_b", "function": {"name": "read_file", "arguments": '{"path": '}}
    messages = episode.messages([sent(unknown, good), sent(broken), {"role": "assistant", "content": None}])
    first, result = messages[2], messages[3]
    assert first["content"] == "Looking." and first["tool_calls"][0]["function"]["name"] == "read_file"
    assert json.loads(first["tool_calls"][0]["function"]["arguments"]) == arguments
    assert first["tool_calls"][0]["id"] != "call_random" and len(first["tool_calls"]) == 1
    assert result == {
        "role": "tool",
        "tool_call_id": first["tool_calls"][0]["id"],
        "content": workloads.tool_result("read_file", arguments),
    }
    again = episode.messages([sent(dict(good, id="call_other")), sent(broken), {"content": None}])
    assert again == messages  # another id from the server: the same prompt
    # The broken call and the empty message: the plan's second and third calls, their text dropped.
    assert [m["tool_calls"][0]["function"]["name"] for m in messages[4::2]] == ["search_docs", "read_file"]
    assert messages[4]["content"] is None
    # A server that does not parse calls sends the block as text: read as the bench reads the model's text.
    block = '<tool_call>\n{"name": "list_files", "arguments": {"path": "app"}}\n</tool_call>'
    assert episode.messages([{"content": block}])[2]["tool_calls"][0]["function"]["name"] == "list_files"
    chat = workloads.episodes("chat")[0]
    assert chat.messages([{"role": "assistant", "content": "first"}]) == chat.messages(["first"])


def test_prompts_fit_with_the_longest_answers(tiny) -> None:
    """Every turn of every episode under the limit in SmolLM2's tokens, each earlier answer as long as the
    episode allows (the agent's: text without a call, which the plan's call replaces, or a call after text)."""
    tok = tiny[1].tokenizer
    filler = tok.encode(" ".join(workloads.user_turns(0, 10)))
    for name in workloads.WORKLOADS:
        for e in workloads.episodes(name):
            longest = tok.decode(filler[: e.max_new_tokens])
            answers = [longest] * e.turns
            if name == "agent":
                call = '\n<tool_call>\n{"name": "list_files", "arguments": {"path": "app"}}\n</tool_call>'
                text = tok.decode(filler[: e.max_new_tokens - len(tok.encode(call))])
                answers = [longest, text + call] * e.turns
            for t in range(e.turns):
                n = len(tok.encode(traffic.render_chat(tok, e.messages(answers[:t]), e.tools)))
                assert n <= PROMPT_LIMIT, (name, e.index, t, n)


def test_bench_workload_flags() -> None:
    args = build_parser().parse_args(
        ["bench", "--workload", "chat", "--workload", "all", "--episodes", "2", "--llama-cpp", "lookup"]
    )
    assert args.workload == ["chat", "all"] and args.episodes == 2 and args.llama_cpp == ["lookup"]
    assert workload_names(args) == ["chat", "agent", "code-edit", "extraction", "rag"]
    assert workload_names(build_parser().parse_args(["bench"])) == []
    assert build_parser().parse_args(["bench"]).max_new_tokens is None  # 128 for Spec-Bench, set in _cmd_bench


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "specbench", "--workload", "rag"], "separate runs"),
        (["--workload", "rag", "--structured"], "leave out --structured"),
        (["--episodes", "2"], "--episodes is for the traffic workloads"),
    ],
)
def test_bench_workload_refusals(argv: list[str], message: str, capsys) -> None:
    assert main(["bench", *argv]) == 1  # refused before any model loads
    assert message in capsys.readouterr().err


def test_a_workload_on_a_base_model_is_one_error_line(tmp_path: Path, capsys) -> None:
    """The traffic workloads are conversations: a target without a chat template (a base model, as Gemma 3 270M's
    GGUF) is refused in one line that says so, not a traceback from the template."""
    from app.bench import synthetic

    base = synthetic.write_tiny_gguf(tmp_path / "base.gguf", "qwen3", chat_template=False)
    assert main(["bench", "--target", str(base), "--workload", "chat", "--no-hf", "--draft", "suffix"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: --workload: base.gguf has no chat template (a base model); its traffic is conversations"


def test_workload_bench_end_to_end(tiny, tmp_path: Path, monkeypatch) -> None:
    """`specserve bench --workload chat --workload code-edit`, one episode each: every configuration on every
    turn with target-only's greedy output, the next chat turn built from target-only's answer, the prediction
    variant on the code edit only, each configuration its own tenant (its first request finds nothing cached
    although target-only sent the same prompt just before; its next turn finds its own), workloads.json and
    workloads.md written."""
    monkeypatch.setattr(factory, "build_engine", lambda *args, **kwargs: tiny)
    seen: list[list[dict]] = []
    render = traffic.render_chat
    monkeypatch.setattr(
        traffic, "render_chat", lambda tok, messages, tools: seen.append(messages) or render(tok, messages, tools)
    )
    out = tmp_path / "out"
    argv = ["bench", "--workload", "chat", "--workload", "code-edit", "--episodes", "1", "-n", "6"]
    assert main([*argv, "--draft", "suffix", "--draft", "ngram", "--out", str(out)]) == 0
    result = json.loads((out / "workloads.json").read_text())
    runs = [traffic.Run(**r) for r in result["runs"]]
    by_turn: dict[str, dict[str, traffic.Run]] = {}
    for r in runs:
        by_turn.setdefault(r.question_id, {})[r.config] = r
    chat, edit = (
        ["none", "suffix/adaptive", "ngram/adaptive"],
        ["none", "suffix/adaptive", "suffix/adaptive/prediction", "ngram/adaptive"],
    )
    assert {q: list(c) for q, c in by_turn.items()} == {
        **{f"chat/0/{t}": chat for t in range(5)},
        "code-edit/0/0": edit,
    }
    tok = tiny[1].tokenizer
    for q, configs in by_turn.items():
        assert all(r.token_ids == configs["none"].token_ids and r.tokens == 6 for r in configs.values()), q
    for t in range(1, 5):  # the history is target-only's answers
        assert seen[t][2 * t] == {
            "role": "assistant",
            "content": tok.decode(by_turn[f"chat/0/{t - 1}"]["none"].token_ids),
        }
    for c in chat:
        assert by_turn["chat/0/0"][c].stats["cached_tokens"] == 0
        assert by_turn["chat/0/1"][c].stats["cached_tokens"] > 0
    summary = result["summary"]
    assert list(summary) == ["chat", "code-edit", "overall"]
    assert summary["chat"]["none"]["identical_to_target_only"] == 5
    entry = summary["code-edit"]["suffix/adaptive/prediction"]
    assert entry["requests"] == 1 and entry["speedup_vs_target_only"] > 0
    assert entry["draft_sources"] is None or isinstance(entry["draft_sources"], dict)
    assert result["meta"]["episodes"] == {"chat": 1, "code-edit": 1}
    table = (out / "workloads.md").read_text()
    assert "| code-edit | suffix/adaptive/prediction | 1 |" in table and "draft sources" in table


def test_workload_configs_order() -> None:
    configs = [traffic.Config("hybrid", "adaptive"), traffic.Config("ngram", "adaptive"), traffic.Config("none")]
    assert [c.label for c in traffic.workload_configs(configs, True)] == [
        "none",
        "hybrid/adaptive",
        "hybrid/adaptive/prediction",
        "ngram/adaptive",
    ]
    assert [c.label for c in traffic.workload_configs(configs, False)] == [
        "none",
        "hybrid/adaptive",
        "ngram/adaptive",
    ]
    assert dataclasses.replace(configs[0], prediction=True).label == "hybrid/adaptive/prediction"


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_lookup_equals_its_target_only(tiny_gguf: Path, tmp_path: Path) -> None:
    """`--llama-cpp lookup`: the binding's prompt-lookup decoding brings llama.cpp target-only along, and its
    greedy tokens are target-only's, on a prompt longer than the binding's batch (its logits buffer must hold
    every position) and on a next turn that extends it (the kept prefix reused)."""
    from app.bench import llamacpp

    runners = llamacpp.runners(tiny_gguf, ["lookup"], tmp_path, threads=2, reuse_prefix=True)
    assert list(runners) == ["llama.cpp/gguf", "llama.cpp/lookup"]
    model = runners["llama.cpp/gguf"].model
    text = "Repeat the list: " + ", ".join(["red", "green", "blue", "yellow"] * 66) + ". The list again:"
    prompt = model.tokenize(text.encode(), add_bos=False)
    assert len(prompt) > 512
    first = [r.run(prompt, 8)[0] for r in runners.values()]
    assert first[0] == first[1] and len(first[0]) == 8
    more = prompt + first[0] + model.tokenize(b" And once more:", add_bos=False)
    second = [r.run(more, 8)[0] for r in runners.values()]
    assert second[0] == second[1]
