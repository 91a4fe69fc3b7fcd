"""GET /v1/files/{id}/preview: examples rendered and tokenized as the training does, token counts."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from tests.api.conftest import TeamKey, chat_jsonl, error_of, uploaded_id
from trainer.data.chat_format import ChatRenderer
from trainer.data.dataset import tokenize_record
from trainer.model.catalog import load_tokenizer

MODEL = "tiny-llama"


def _preview(client: TestClient, team: TeamKey, file_id: str, **params: int | str):  # type: ignore[no-untyped-def]
    return client.get(f"/v1/files/{file_id}/preview", params={"model": MODEL, **params}, headers=team.headers)


def test_preview_renders_pieces_and_counts_tokens(client: TestClient, team: TeamKey) -> None:
    content = chat_jsonl(8)
    fid = uploaded_id(client, team, content)
    r = _preview(client, team, fid, limit=3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "file.preview" and body["model"] == MODEL
    assert isinstance(body["max_seq_length"], int) and body["truncated_at"] is None

    tokenizer = load_tokenizer(MODEL)
    renderer = ChatRenderer(tokenizer)
    records = [json.loads(line) for line in content.decode().splitlines()]
    expected = [len(tokenize_record(rec, "chat", tokenizer, renderer=renderer).input_ids) for rec in records]
    assert body["token_counts"] == expected

    assert [ex["line"] for ex in body["examples"]] == [1, 2, 3]
    for ex, rec in zip(body["examples"], records, strict=False):
        text, _ = renderer.render(rec)
        assert "".join(p["text"] for p in ex["pieces"]) == text
        learned = "".join(p["text"] for p in ex["pieces"] if p["learned"])
        answer = rec["messages"][-1]["content"]
        assert learned.startswith(answer)
        marker = learned[len(answer) :]
        assert marker.strip() and marker in (tokenizer.eos_token, *tokenizer.all_special_tokens), marker
        tokens = tokenize_record(rec, "chat", tokenizer, renderer=renderer)
        assert ex["tokens"] == len(tokens.input_ids) and ex["learned_tokens"] == tokens.num_loss_tokens
        assert all(p["text"] for p in ex["pieces"])


def test_preview_skips_invalid_lines_and_weight_zero_turns(client: TestClient, team: TeamKey) -> None:
    rec = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "not this", "weight": 0},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "this"},
        ]
    }
    content = chat_jsonl(1) + (json.dumps(rec) + "\n").encode()
    fid = uploaded_id(client, team, content)
    body = _preview(client, team, fid).json()
    assert [ex["line"] for ex in body["examples"]] == [1, 2] and len(body["token_counts"]) == 2
    learned = [p["text"] for p in body["examples"][1]["pieces"] if p["learned"]]
    assert len(learned) == 1 and learned[0].startswith("this")


def test_preview_is_the_teams_own(client: TestClient, team: TeamKey, other_team: TeamKey) -> None:
    fid = uploaded_id(client, team)
    r = _preview(client, other_team, fid)
    assert r.status_code == 404 and error_of(r)["param"] == "file_id"
    r = _preview(client, team, "file-nope")
    assert r.status_code == 404


def test_preview_bad_limit_or_model_is_400(client: TestClient, team: TeamKey) -> None:
    fid = uploaded_id(client, team)
    for limit in (0, 51, "x"):
        r = _preview(client, team, fid, limit=limit)
        assert r.status_code == 400 and error_of(r)["param"] == "limit", r.text
    for model in ("no-such-model", "/etc", "ft:tiny-llama:other:abc"):
        r = client.get(f"/v1/files/{fid}/preview", params={"model": model}, headers=team.headers)
        assert r.status_code == 400 and error_of(r)["param"] == "model", r.text
    r = client.get(f"/v1/files/{fid}/preview", headers=team.headers)
    assert r.status_code == 400 and error_of(r)["param"] == "model"
