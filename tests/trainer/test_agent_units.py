"""The agent loop's pure parts: parsing tool calls, the search tool's responses, rendering them as tokens,
truncation, the settings. verl's tool config files: test_agent_tools.py. The loop itself, against a real
retrieval-server: test_agent_loop.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.retrieval_server.schemas import Document, Hit
from testing.tiny import load_tiny_tokenizer
from trainer.agent.formats import (
    HermesFormat,
    SearchR1Format,
    ToolCall,
    Truncation,
    encode_literal,
    make_format,
)
from trainer.agent.loop import AgentSettings, ToolClock
from trainer.agent.search import SearchOutcome, query_list, search_result

ROOT = Path(__file__).resolve().parents[2]
HITS = [
    Hit(document=Document(id="a", contents='"Norvik River"\nIt ends in the Amber Sea.'), score=2.0),
    Hit(document=Document(id="b", contents='"Amber Sea"\nA shallow sea.'), score=1.0),
]


@pytest.fixture(scope="module")
def char_tok():
    return load_tiny_tokenizer("char")


@pytest.fixture(scope="module")
def qwen_tok():
    return load_tiny_tokenizer("qwen")


# ------------------------------------------------------------------------------------------ Search-R1


def test_search_r1_parse_takes_the_first_closed_action():
    fmt = SearchR1Format(load_tiny_tokenizer("char"))
    search = ToolCall("search", {"query_list": ["Norvik River"]})
    assert fmt.parse("<think>hm</think>\n<search> Norvik River </search>") == [search]
    assert fmt.parse("<answer> Amber </answer>") == []  # an answer ends the trajectory
    assert fmt.parse("<answer>Amber</answer> <search>late</search>") == []
    assert fmt.parse("<search>first</search><answer>x</answer>") == [
        ToolCall("search", {"query_list": ["first"]})
    ]
    assert fmt.parse("I think it is Amber.") == []  # no action: the trajectory ends (as verl)
    assert fmt.parse("<search> unclosed") == []
    (empty,) = fmt.parse("<search>  \n </search>")
    assert empty.arguments == {} and "empty" in empty.problem
    # the tags call the search tool by its name in the run's tool config
    assert (
        SearchR1Format(load_tiny_tokenizer("char"), tool_name="wiki").parse("<search>q</search>")[0].name
        == "wiki"
    )


def test_search_r1_observation_wraps_each_response_in_information_tags(char_tok):
    fmt = SearchR1Format(char_tok)
    text = search_result("search_r1", SearchOutcome(hits=[HITS])).text
    # Search-R1's passage format, stripped as Search-R1 strips it before wrapping
    assert (
        text
        == 'Doc 1(Title: "Norvik River") It ends in the Amber Sea.\nDoc 2(Title: "Amber Sea") A shallow sea.'
    )
    ids = fmt.observation([encode_literal(char_tok, text)], turn_tail="")
    assert char_tok.decode(ids) == f"\n\n<information>{text}</information>\n\n"
    failed = search_result("search_r1", SearchOutcome(error="the retrieval service did not answer"))
    assert failed.text.startswith("The search failed (the retrieval service did not answer)")
    assert failed.status == "failed"  # the loop's tool_failure policy applies


# ------------------------------------------------------------------------------------------ hermes


def test_hermes_parse_reads_verl_search_tool_calls():
    fmt = HermesFormat(load_tiny_tokenizer("char"), tool_names=("search", "code_interpreter"))
    text = '<tool_call>\n{"name": "search", "arguments": {"query_list": ["a b", " c "]}}\n</tool_call>'
    assert fmt.parse(text) == [ToolCall("search", {"query_list": ["a b", " c "]})]
    as_string = '<tool_call>{"name": "search", "arguments": "{\\"query_list\\": [\\"q\\"]}"}</tool_call>'
    assert fmt.parse(as_string) == [ToolCall("search", {"query_list": ["q"]})]
    assert fmt.parse("The answer is <answer>Amber</answer>") == []
    # either tool, in one turn, in the order written
    code = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(1)"}}</tool_call>'
    assert [(c.name, c.arguments) for c in fmt.parse(text + "\n" + code)] == [
        ("search", {"query_list": ["a b", " c "]}),
        ("code_interpreter", {"code": "print(1)"}),
    ]


@pytest.mark.parametrize(
    "body, problem",
    [
        ('{"name": "search", "arguments": {"query_list": [}}', "not valid JSON"),
        ('{"name": "calculator", "arguments": {"x": 1}}', "unknown tool 'calculator'"),
        ('{"name": "search", "arguments": [1, 2]}', "must be a JSON object"),
        ('["search"]', '{"name": ..., "arguments": {...}}'),
    ],
)
def test_hermes_calls_that_cannot_run_carry_the_problem(body, problem):
    (call,) = HermesFormat(load_tiny_tokenizer("char")).parse(f"<tool_call>{body}</tool_call>")
    assert call.arguments == {} and problem in call.problem


@pytest.mark.parametrize(
    "arguments, problem",
    [
        ({"query": "a"}, "'query_list' is missing"),
        ({"query_list": []}, "'query_list' is missing"),
        ({"query_list": "a"}, "'query_list' is missing"),
        ({"query_list": ["ok", " "]}, "empty query"),
    ],
)
def test_search_arguments_are_checked_as_verl_search_tool_checks_them(arguments, problem):
    queries, found = query_list(arguments)
    assert queries == () and problem in found
    assert query_list({"query_list": [" a b ", "c"]}) == (("a b", "c"), None)


def test_hermes_results_are_verl_search_tool_json():
    result = search_result("hermes", SearchOutcome(hits=[HITS[:1], HITS[1:]]))
    assert result.status == "ok" and json.loads(result.text) == {
        "result": 'Doc 1 (Title: "Norvik River")\nIt ends in the Amber Sea.\n---\n'
        'Doc 1 (Title: "Amber Sea")\nA shallow sea.'
    }
    failed = search_result("hermes", SearchOutcome(error="down"))
    assert failed.status == "failed" and json.loads(failed.text) == {"result": "Search error: down"}
    empty = search_result("hermes", SearchOutcome(hits=[[]]))
    assert empty.status == "ok" and json.loads(empty.text) == {"result": "No search results found."}


def test_hermes_observation_is_the_chat_template_of_tool_messages(qwen_tok):
    fmt = HermesFormat(qwen_tok)
    content = encode_literal(qwen_tok, '{"result": "R"}')
    ids = fmt.observation([content], turn_tail="</tool_call>")
    # Qwen's template: the assistant turn closes, tool responses go in a user turn, the next turn opens
    expected = '<|im_end|>\n<|im_start|>user\n<tool_response>\n{"result": "R"}\n</tool_response><|im_end|>\n'
    assert qwen_tok.decode(ids) == expected + "<|im_start|>assistant\n"
    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    assert ids[0] == im_end and ids.count(im_end) == 2  # template tokens are the special ids
    # a model that closed its turn itself does not get a second <|im_end|>
    closed = fmt.observation([content], turn_tail="<|im_end|>")
    assert closed == ids[1:]
    two = fmt.observation([content, content], turn_tail="")
    assert (
        qwen_tok.decode(two).count("<tool_response>") == 2 and qwen_tok.decode(two).count("<|im_start|>") == 2
    )


def test_hermes_turns_after_a_tool_open_with_the_prompts_template_and_kwargs(qwen_tok):
    # a template whose generation prompt depends on a kwarg, as Qwen3's does on enable_thinking: the turn
    # after a tool's answer must open as the prompt's first turn did
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>"
        "{% if not enable_thinking %}[no think]{% endif %}{% endif %}"
    )
    fmt = make_format("hermes", qwen_tok, chat_template=template, template_kwargs={"enable_thinking": False})
    ids = fmt.observation([encode_literal(qwen_tok, "R")], turn_tail="")
    assert qwen_tok.decode(ids) == "</assistant><tool>R</tool><assistant>[no think]"
    thinking = make_format(
        "hermes", qwen_tok, chat_template=template, template_kwargs={"enable_thinking": True}
    )
    assert qwen_tok.decode(thinking.observation([encode_literal(qwen_tok, "R")], turn_tail="")).endswith(
        "<assistant>"
    )


def test_tool_output_cannot_inject_control_tokens(qwen_tok):
    ids = encode_literal(qwen_tok, "passage <|im_end|> text")
    assert qwen_tok.convert_tokens_to_ids("<|im_end|>") not in ids
    assert qwen_tok.decode(ids) == "passage <|im_end|> text"


def test_hermes_stops_at_the_call_only_with_one_call_per_turn(char_tok):
    assert make_format("hermes", char_tok).stop == ("</tool_call>",)
    assert make_format("hermes", char_tok, max_parallel_calls=2).stop == ()
    with pytest.raises(ValueError, match="search_r1 or hermes"):
        make_format("react", char_tok)


def test_a_template_without_tool_messages_is_refused_at_start(char_tok):
    tok = load_tiny_tokenizer("char")
    tok.chat_template = (
        "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="does not render tool messages"):
        make_format("hermes", tok)


# ------------------------------------------------------------------------------------------ truncation


def test_truncation_keeps_the_side_verl_names(char_tok):
    ids = list(range(100, 120))  # 20 tokens, cap 6
    left = Truncation.build(char_tok, 6, "left")
    right = Truncation.build(char_tok, 6, "right")
    middle = Truncation.build(char_tok, 7, "middle")
    # left: the start survives, the marker goes where the cut is (verl's "left" keeps text[:max])
    assert left.apply(ids) == ids[:6] + encode_literal(char_tok, "...(truncated)")
    assert right.apply(ids) == encode_literal(char_tok, "(truncated)...") + ids[-6:]
    # middle, cap 7: 3 from the start, 4 from the end
    assert middle.apply(ids) == ids[:3] + encode_literal(char_tok, "...(truncated)...") + ids[-4:]
    assert left.apply(ids[:6]) == ids[:6]  # at the cap: untouched
    with pytest.raises(ValueError):
        Truncation.build(char_tok, 0, "left")
    with pytest.raises(ValueError):
        Truncation.build(char_tok, 5, "both")


# ------------------------------------------------------------------------------------------ settings


def test_agent_settings_refuse_nonsense():
    with pytest.raises(ValueError):
        AgentSettings(max_response_length=0)
    with pytest.raises(ValueError):
        AgentSettings(max_response_length=10, max_assistant_turns=0)
    with pytest.raises(ValueError, match="text, drop_group or retry"):
        AgentSettings(max_response_length=10, tool_failure="ignore")
    with pytest.raises(ValueError, match="tool_failure_retries"):
        AgentSettings(max_response_length=10, tool_failure="retry", tool_failure_retries=0)
    # tries of one call: only the retry policy tries again
    assert AgentSettings(max_response_length=10, tool_failure="retry", tool_failure_retries=3).tries == 4
    assert AgentSettings(max_response_length=10, tool_failure="drop_group").tries == 1


def test_tool_clock_counts_overlapping_calls_once():
    clock = ToolClock()
    with clock:
        with clock:  # a second call while the first is in flight adds no time of its own
            pass
        inner = clock.seconds
    assert inner == 0.0 and clock.seconds > 0.0


# ------------------------------------------------------------------------------------------ the trainer


def test_config_turns_multi_turn_on_with_the_built_in_engine():
    from trainer.config import checks, load_config

    tool_config = ROOT / "jobgroup" / "tools" / "search_tool_config.yaml"
    cfg = load_config(
        [
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.format=search_r1",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
            "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=500",
            "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=left",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config}",
            "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=true",  # verl's, no effect
        ]
    )
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    assert (multi_turn.format, multi_turn.max_assistant_turns, multi_turn.max_tool_response_length) == (
        "search_r1",
        3,
        500,
    )
    assert cfg.actor_rollout_ref.rollout.engine == "builtin"  # the async, continuously batching engine
    notices = "\n".join(checks.notices(cfg))
    assert "rate_limit" in notices and "use_inference_chat_template" in notices
    assert "multi-turn tool calls run on the builtin engine" in notices  # rollout.name=hf was asked for
    single = load_config([])
    assert (
        single.actor_rollout_ref.rollout.engine == "builtin"
        and not single.actor_rollout_ref.rollout.multi_turn.enable
    )


def test_config_refuses_what_the_agent_loop_cannot_run(tmp_path):
    from trainer.config import ConfigError, load_config

    on = "actor_rollout_ref.rollout.multi_turn.enable=true"
    with pytest.raises(ConfigError, match="tool_config_path: .* is not a file"):
        load_config([on, f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'none.yaml'}"])
    with pytest.raises(ConfigError, match="multi_turn.format"):
        load_config([on, "actor_rollout_ref.rollout.multi_turn.format=react"])
    with pytest.raises(ConfigError, match="max_assistant_turns"):
        load_config([on, "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=0"])
    # tool calls run at every scale: Ray ranks' engines are replicas of the same rollout manager
    ray = load_config(
        [on, "trainer.use_ray=true", "trainer.nnodes=2", "services.retrieval_url=[http://r:8002]"]
    )
    assert ray.uses_ray and ray.actor_rollout_ref.rollout.engine == "builtin"
    sglang = load_config([on, "actor_rollout_ref.rollout.name=sglang"])  # its servers have the async path too
    assert sglang.actor_rollout_ref.rollout.engine == "sglang"


def test_response_length_metrics_count_the_model_tokens_and_clip_on_the_whole_response():
    import torch

    from trainer.tracking import compute_data_metrics

    # row 0: 2 model tokens, 2 tool tokens, 1 model token, padding: 3 trained of 5; row 1: 6 of 6
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.float32)
    metrics = compute_data_metrics(
        scores=torch.tensor([1.0, 0.0]),
        advantages=torch.zeros(2, 6),
        response_mask=mask,
        response_lengths=mask.sum(-1),
        total_response_lengths=torch.tensor([5, 6]),
        prompt_lengths=torch.tensor([4, 4]),
        max_response_length=6,
        max_prompt_length=8,
    )
    assert metrics["response_length/mean"] == 4.5  # (3 + 6) / 2: the tool tokens are not counted
    assert metrics["response_length/min"] == 3 and metrics["response_length/max"] == 6
    assert metrics["response_length/clip_ratio"] == 0.5  # row 1 used the whole budget
