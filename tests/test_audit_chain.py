"""The audit log's hash chain as the writer keeps it: the format of a line (what is hashed), the
chain continued across restarts of the writer and of the gateway, a torn last line vouched for,
one chain per replica."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx

from nowait.gateway.audit import GENESIS, AuditLog, read_audit_log, verify_audit_log
from nowait.gateway.audit.chain import hashed_line
from tests.gateway_support import API_KEY, base_config, free_port, live_server, save_tiny_models


def write(path: Path, count: int, replica: str = "local", start: int = 0) -> None:
    log = AuditLog(path, replica=replica)
    for number in range(start, start + count):
        log.record({"request_id": f"req-{number}", "tenant": "team-a", "cost_usd": 0.001 * number})
    log.close()


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines()


def test_a_line_is_its_canonical_json_and_its_hash_covers_every_other_field(tmp_path):
    """Recomputed here from the documented rule, not from the module's own helpers: sorted keys,
    no spaces, UTF-8 as itself, SHA-256 over everything but `hash`."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.record({"request_id": "req-1", "model": "modèle", "engines_tried": ({"engine": "ar"},), "where": tmp_path})
    log.record({"request_id": "req-2"})
    log.close()
    first, second = lines(path)
    entry = json.loads(first)
    assert first == json.dumps(entry, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    assert "modèle".encode() in first  # UTF-8 as itself, not \u escapes
    without_hash = {k: v for k, v in entry.items() if k != "hash"}
    canonical = json.dumps(without_hash, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert entry["hash"] == hashlib.sha256(canonical).hexdigest()
    assert (entry["prev"], entry["seq"], entry["replica"]) == (GENESIS, 0, "local")
    assert entry["engines_tried"] == [{"engine": "ar"}] and entry["where"] == str(tmp_path)  # hashed as read back
    follower = json.loads(second)
    assert (follower["prev"], follower["seq"]) == (entry["hash"], 1)


def test_the_line_written_in_one_pass_is_the_documented_one(tmp_path):
    """`hashed_line` writes an entry once (the chain's per-request cost); its hash and line must be
    exactly those of the rule: every other field hashed, the line canonical, read back alike."""
    entries = [
        {"a": 1, "z": [1.5, None, True], "has": "x", "hasha": {"k": "é"}, "seq": 0, "prev": GENESIS},
        {"zzz": 1},  # nothing sorts before `hash`
        {"aaa": 1},  # nothing after it
        {},
        {"t": (1, 2), "where": tmp_path, "n": {3: "int key"}},  # not plain: as JSON reads it back
        {"client": "lone \ud800 surrogate", "nan": float("nan")},
        {"a": {"hash": "inner"}, "text": '"hash":"' + "0" * 64 + '"', "z": {"hash": {"hash": 1}}},  # look-alikes
    ]
    for entry in entries:
        digest, line = hashed_line(entry)
        read = json.loads(line)
        assert line == json.dumps(read, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        without_hash = {k: v for k, v in read.items() if k != "hash"}
        rule = json.dumps(without_hash, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        assert read["hash"] == digest == hashlib.sha256(rule).hexdigest(), entry
        assert set(read) == {*map(str, entry), "hash"}


def test_the_chain_continues_across_a_restart_of_the_writer(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, 3)
    write(path, 2, start=3)
    entries = read_audit_log(path)
    assert [e["seq"] for e in entries] == [0, 1, 2, 3, 4]
    assert entries[3]["prev"] == entries[2]["hash"]  # the second writer read the first one's last hash
    verdict = verify_audit_log(path)
    assert verdict.ok and verdict.entries == 5
    assert verdict.replicas["local"].last_hash == entries[-1]["hash"]


def test_a_writer_reports_its_last_hash(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl")
    assert log.last_hash == GENESIS
    log.record({"request_id": "req-1"})
    assert log.last_hash == read_audit_log(tmp_path / "audit.jsonl")[0]["hash"]
    log.close()


def test_a_torn_last_line_is_reported_then_vouched_for_by_the_next_entry(tmp_path):
    """A crash cuts the last write short: verify says so (exit 1: the end is not proven whole);
    the restarted writer puts its next entry on a new line that vouches for the fragment, after
    which the log verifies, the fragment named as a torn write."""
    path = tmp_path / "audit.jsonl"
    write(path, 3)
    whole = lines(path)
    with path.open("ab") as handle:
        handle.write(whole[0][:40])  # what a write cut after 40 bytes leaves
    torn = verify_audit_log(path)
    assert not torn.ok and torn.broken.kind == "torn" and torn.broken.line == 4
    restarted = AuditLog(path)
    assert verify_audit_log(path).broken.kind == "torn"  # nothing vouches for it until the next entry
    restarted.close()
    write(path, 1, start=3)  # a second restart before any entry: the fragment is still the last line
    verdict = verify_audit_log(path)
    assert verdict.ok and verdict.entries == 4 and verdict.torn_lines == [4]
    after = read_audit_log(path)
    assert after[-1]["seq"] == 3 and after[-1]["prev"] == after[-2]["hash"]
    assert after[-1]["torn"] == [{"bytes": 40, "sha256": hashlib.sha256(whole[0][:40]).hexdigest()}]


def test_a_first_write_after_a_restart_torn_too_is_vouched_for_with_the_first(tmp_path):
    """Two crashes in a row, the second during the first write after the restart: both fragments
    are vouched for by the next entry, in order."""
    path = tmp_path / "audit.jsonl"
    write(path, 2)
    with path.open("ab") as handle:
        handle.write(b'{"request_id":"first-cut')
    AuditLog(path).close()  # restarted: the fragment now ends with a newline
    with path.open("ab") as handle:
        handle.write(b'{"request_id":"second-cut","ten')
    assert verify_audit_log(path).broken.kind == "torn"
    write(path, 1, start=2)
    verdict = verify_audit_log(path)
    assert verdict.ok and verdict.entries == 3 and verdict.torn_lines == [3, 4]
    assert [t["bytes"] for t in read_audit_log(path)[-1]["torn"]] == [24, 31]


def test_a_vouched_fragment_edited_afterwards_is_caught(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, 2)
    with path.open("ab") as handle:
        handle.write(b'{"request_id": "cut')
    write(path, 1, start=2)
    assert verify_audit_log(path).ok
    path.write_bytes(path.read_bytes().replace(b'"cut', b'"cux'))
    broken = verify_audit_log(path).broken
    assert broken.kind == "altered" and broken.line == 3


def test_a_last_entry_missing_only_its_newline_is_continued_not_vouched_for(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, 2)
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    write(path, 1, start=2)
    entries = read_audit_log(path)
    assert [e["seq"] for e in entries] == [0, 1, 2] and "torn" not in entries[-1]
    assert verify_audit_log(path).ok


def test_each_replica_keeps_its_own_chain_in_one_file(tmp_path):
    """Room for the shared store: entries of two replicas interleaved, each chain continued from
    its own last entry (found behind the other's) and checked on its own."""
    path = tmp_path / "audit.jsonl"
    write(path, 2, replica="gw-1")
    write(path, 3, replica="gw-2")
    write(path, 1, replica="gw-1", start=2)
    entries = read_audit_log(path)
    assert [(e["replica"], e["seq"]) for e in entries] == [("gw-1", 0), ("gw-1", 1), ("gw-2", 0), ("gw-2", 1),
                                                           ("gw-2", 2), ("gw-1", 2)]
    assert entries[5]["prev"] == entries[1]["hash"]
    verdict = verify_audit_log(path)
    assert verdict.ok and verdict.entries == 6
    assert {name: state.entries for name, state in verdict.replicas.items()} == {"gw-1": 3, "gw-2": 3}


def test_the_chain_continues_across_a_restart_of_the_gateway(tmp_path, codec):
    models = save_tiny_models(tmp_path / "models", codec)
    data = tmp_path / "data"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "ar", "max_tokens": 2, "messages": [{"role": "user", "content": "Name: Ann Lee"}]}
    for run in range(2):
        with live_server(base_config(models, data, free_port())) as server:
            for _ in range(2):
                assert httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers,
                                  timeout=60).status_code == 200
        entries = read_audit_log(data / "audit.jsonl")
        assert len(entries) == 2 * (run + 1)
    assert [e["seq"] for e in entries] == [0, 1, 2, 3]
    assert entries[2]["prev"] == entries[1]["hash"]
    verdict = verify_audit_log(data / "audit.jsonl")
    assert verdict.ok and verdict.entries == 4
