"""Chat sources: ShareGPT recovery, user formats, role normalisation and skip reasons."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from eyas.data.sources import (
    EMPTY_TURN,
    MALFORMED,
    NO_ASSISTANT,
    NON_TEXT,
    NOT_ALTERNATING,
    UNKNOWN_ROLE,
    Conversation,
    Skipped,
    iter_conversations,
    normalise,
)
from eyas.errors import EyasError


def test_embedded_sharegpt_is_recovered_whole():
    infos = []
    items = list(iter_conversations("sharegpt", info_out=infos))
    info = infos[0]
    assert info.records == 17671 and len(items) == 17671
    assert info.truncated and "truncated" in info.notes[0] and "17671" in info.notes[0]
    # the last recovered record is whole: it has its id and complete turns
    last = items[-1]
    assert last.id and (isinstance(last, Skipped) or last.messages[-1]["content"])
    counts = Counter(getattr(i, "reason", "ok") for i in items)
    assert counts["ok"] > 17000
    assert len({i.id for i in items}) == len(items)  # ids unique


def test_truncated_file_recovery_counts_whole_records(tmp_path):
    recs = [
        {"id": str(i), "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": f"a{i}"}]}
        for i in range(5)
    ]
    text = json.dumps(recs, indent=1)
    cut = text[: text.index('"a4"') + 2]  # cut inside the last record
    p = tmp_path / "cut.json"
    p.write_text(cut)
    infos = []
    items = list(iter_conversations(p, info_out=infos))
    assert [i.id for i in items] == ["0", "1", "2", "3"] and infos[0].truncated
    assert items[-1].messages[-1]["content"] == "a3"


def test_malformed_json_names_the_line(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('[\n{"id": 1, "messages": []},\n{"id": 2 "messages": []}\n]')
    with pytest.raises(EyasError, match=r"bad.json.*line 3"):
        list(iter_conversations(p))


def test_malformed_jsonl_names_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{oops\n')
    with pytest.raises(EyasError, match=r"bad.jsonl.*line 2"):
        list(iter_conversations(p))


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(EyasError, match="does not exist"):
        list(iter_conversations(tmp_path / "nope.jsonl"))
    (tmp_path / "d").mkdir()
    with pytest.raises(EyasError, match="not a known dataset format"):
        list(iter_conversations(tmp_path / "d"))
    weird = tmp_path / "x.txt"
    weird.write_text("hello")
    with pytest.raises(EyasError, match="unknown dataset format"):
        list(iter_conversations(weird))


def test_openai_jsonl_and_hf_dataset(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "chatgpt", "value": "a"}]},
    ]
    p = tmp_path / "chats.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    items = list(iter_conversations(p))
    assert all(isinstance(i, Conversation) for i in items)
    assert [m["role"] for m in items[1].messages] == ["user", "assistant"]

    import datasets

    datasets.Dataset.from_list([{"messages": rows[0]["messages"]}] * 3).save_to_disk(str(tmp_path / "hf"))
    items = list(iter_conversations(tmp_path / "hf"))
    assert len(items) == 3 and items[0].messages[1]["content"] == "hello"
    datasets.DatasetDict({"test": datasets.Dataset.from_list([{"messages": rows[0]["messages"]}])}).save_to_disk(
        str(tmp_path / "hfd")
    )
    with pytest.raises(EyasError, match="--hf-split"):
        list(iter_conversations(tmp_path / "hfd"))
    assert len(list(iter_conversations(tmp_path / "hfd", hf_split="test"))) == 1


def test_hf_split_is_refused_where_it_would_be_ignored(tmp_path):
    """--hf-split picks a split of a saved DatasetDict; with any other source it is refused, not dropped."""
    import datasets

    p = tmp_path / "chats.jsonl"
    p.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n"
    )
    with pytest.raises(
        EyasError, match=r"^--hf-split validation: --source .*chats\.jsonl is a file, not a DatasetDict"
    ):
        list(iter_conversations(p, hf_split="validation"))
    with pytest.raises(EyasError, match=r"^--hf-split train: --source sharegpt is the embedded ShareGPT file"):
        list(iter_conversations("sharegpt", hf_split="train"))
    regen = tmp_path / "regen"
    regen.mkdir()
    (regen / "chats.jsonl").write_text("")
    with pytest.raises(EyasError, match=r"is an `eyas regenerate` output"):
        list(iter_conversations(regen, hf_split="train"))
    datasets.Dataset.from_list([{"messages": []}]).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(EyasError, match=r"is a single saved Dataset \(no splits\)"):
        list(iter_conversations(tmp_path / "hf", hf_split="train"))


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("human", "user"),
        ("user", "user"),
        ("gpt", "assistant"),
        ("chatgpt", "assistant"),
        ("bing", "assistant"),
        ("bard", "assistant"),
        ("GPT", "assistant"),
        ("model", "assistant"),
    ],
)
def test_roles_are_normalised(raw, expected):
    first = "user" if expected == "assistant" else raw
    second = raw if expected == "assistant" else "gpt"
    c = normalise({"conversations": [{"from": first, "value": "x"}, {"from": second, "value": "y"}]}, "id")
    assert isinstance(c, Conversation)
    assert c.messages[0 if expected == "user" else 1]["role"] == expected


def test_system_turn_kept_and_leading_assistant_dropped():
    c = normalise(
        {
            "conversations": [
                {"from": "system", "value": "s"},
                {"from": "gpt", "value": "hello first"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
            ]
        },
        "id",
    )
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant"]


@pytest.mark.parametrize(
    "turns,reason",
    [
        ([{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}], EMPTY_TURN),
        ([{"from": "human", "value": "q"}], NO_ASSISTANT),
        ([{"from": "human", "value": "q"}, {"from": "robot", "value": "a"}], UNKNOWN_ROLE),
        ([{"from": "human", "value": "q"}, {"from": "gpt", "value": {"image": 1}}], NON_TEXT),
        (
            [{"from": "human", "value": "q"}, {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a"}],
            NOT_ALTERNATING,
        ),
    ],
)
def test_skip_reasons(turns, reason):
    item = normalise({"id": "x", "conversations": turns}, "fallback")
    assert isinstance(item, Skipped) and item.reason == reason and item.id == "x"


def test_malformed_record_is_skipped_not_fatal():
    assert normalise(["not", "a", "dict"], "f").reason == MALFORMED
    assert normalise({"id": 1, "text": "no turns"}, "f").reason == MALFORMED


def test_mtbench_has_80_two_turn_questions():
    from eyas.specdec.generate import load_prompts  # the loader `eyas eval` uses

    qs = load_prompts("mtbench")
    assert len(qs) == 80 and all(len(q.turns) == 2 for q in qs)
    assert len({q.id for q in qs}) == 80 and {q.category for q in qs} >= {"writing", "coding", "math"}
