"""`nowait audit verify` and `nowait audit spend` on the real `nowait` app (Typer's CliRunner):
every kind of tampering named at the entry where it happened, with exit status 1; spend summed
from a run of two tenants, equal to what each request cost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nowait.cli import app
from nowait.gateway.audit import AuditLog, read_audit_log, verify_audit_log
from tests.audit_support import two_tenant_run

runner = CliRunner()
ENTRIES = 6


def invoke(*args: str):
    return runner.invoke(app, list(args), prog_name="nowait")


@pytest.fixture
def log_path(tmp_path) -> Path:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    for number in range(ENTRIES):
        log.record({"request_id": f"req-{number}", "tenant": "team-a", "status": 200, "cost_usd": 0.25 * number})
    log.close()
    return path


def rewrite(path: Path, change) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(change(lines)))


def test_an_untouched_log_verifies_with_its_entry_count(log_path):
    result = invoke("audit", "verify", str(log_path))
    assert result.exit_code == 0, result.output
    assert f"{ENTRIES} entries checked" in result.output
    verdict = json.loads(invoke("audit", "verify", str(log_path), "--json").stdout)
    assert verdict["ok"] and verdict["entries"] == ENTRIES and verdict["broken"] is None
    assert verdict["replicas"]["local"]["last_hash"] == read_audit_log(log_path)[-1]["hash"]


def test_editing_one_byte_is_caught_at_its_entry(log_path):
    rewrite(log_path, lambda lines: [*lines[:2], lines[2].replace(b'"cost_usd":0.5', b'"cost_usd":0.6'), *lines[3:]])
    result = invoke("audit", "verify", str(log_path))
    assert result.exit_code == 1
    assert "altered" in result.output and "line 3" in result.output and "req-2" in result.output
    broken = json.loads(invoke("audit", "verify", str(log_path), "--json").stdout)["broken"]
    assert (broken["kind"], broken["line"], broken["seq"], broken["request_id"]) == ("altered", 3, 2, "req-2")


def test_every_single_byte_edit_of_an_entry_is_caught_at_that_entry(log_path):
    """Each byte of the fourth line flipped in turn (a digit, a quote, a brace, a hash nibble...):
    none slips through, and each is named at line 4 (a line broken into two by a newline too)."""
    original = log_path.read_bytes()
    lines = original.splitlines(keepends=True)
    start = sum(len(line) for line in lines[:3])
    for offset in range(len(lines[3]) - 1):  # every byte but the newline
        data = bytearray(original)
        data[start + offset] ^= 0x01
        log_path.write_bytes(bytes(data))
        broken = verify_audit_log(log_path).broken
        assert broken is not None and broken.line == 4 and broken.kind == "altered", (offset, broken)


@pytest.mark.parametrize(("before", "after"), [(b'"cost_usd":0.5,', b'"cost_usd":5e-1,'),
                                               (b'"cost_usd":0.5,', b'"cost_usd": 0.5,')])
def test_an_edit_that_leaves_the_json_equal_is_caught(log_path, before, after):
    """A number respelled or a space added: the parsed entry and its hash are unchanged, the line
    is no longer what the writer wrote."""
    rewrite(log_path, lambda lines: [*lines[:2], lines[2].replace(before, after), *lines[3:]])
    assert json.loads(log_path.read_bytes().splitlines()[2]) == json.loads(
        log_path.read_bytes().splitlines()[2].replace(after, before))
    result = invoke("audit", "verify", str(log_path))
    assert result.exit_code == 1 and "altered" in result.output and "line 3" in result.output


def test_deleting_a_line_names_the_removed_entry(log_path):
    rewrite(log_path, lambda lines: [*lines[:2], *lines[3:]])
    result = invoke("audit", "verify", str(log_path))
    assert result.exit_code == 1
    assert "removed" in result.output and "entry 2 " in result.output
    broken = json.loads(invoke("audit", "verify", str(log_path), "--json").stdout)["broken"]
    assert (broken["kind"], broken["line"], broken["seq"]) == ("removed", 3, 2)


def test_deleting_the_first_line_is_caught(log_path):
    rewrite(log_path, lambda lines: lines[1:])
    result = invoke("audit", "verify", str(log_path))
    assert result.exit_code == 1 and "removed" in result.output and "entry 0 " in result.output


@pytest.mark.parametrize("forged", ["copy", "hand-written", "empty", "rehashed"])
def test_inserting_a_line_is_caught(log_path, forged):
    """A copy of an earlier entry, a plain hand-written line, an empty line, and one built with a
    valid hash and link in place of the entry that follows it: each is found at the insertion."""
    lines = log_path.read_bytes().splitlines(keepends=True)
    if forged == "copy":
        extra, named = lines[1], 5
    elif forged == "empty":
        extra, named = b"\n", 5
    elif forged == "hand-written":
        extra, named = b'{"request_id":"req-x","tenant":"team-b","cost_usd":0.0}\n', 5
    else:
        from nowait.gateway.audit.chain import canonical, entry_hash

        fake = {**json.loads(lines[4]), "request_id": "req-x", "cost_usd": 0.0}
        fake["hash"] = entry_hash(fake)  # same seq and prev as the real line 5 it goes before
        extra, named = canonical(fake) + b"\n", 6
    log_path.write_bytes(b"".join([*lines[:4], extra, *lines[4:]]))
    result = invoke("audit", "verify", str(log_path))
    assert result.exit_code == 1
    assert "inserted" in result.output and f"line {named}" in result.output


def test_swapping_two_lines_is_caught_as_reordered(log_path):
    rewrite(log_path, lambda lines: [*lines[:2], lines[3], lines[2], *lines[4:]])
    result = invoke("audit", "verify", str(log_path))
    assert result.exit_code == 1
    assert "reordered" in result.output and "line 3" in result.output
    broken = json.loads(invoke("audit", "verify", str(log_path), "--json").stdout)["broken"]
    assert (broken["kind"], broken["line"], broken["seq"]) == ("reordered", 3, 3)


def test_a_torn_last_line_fails_verification_as_torn(log_path):
    with log_path.open("ab") as handle:
        handle.write(b'{"cost_usd":0.1,"hash":"ab')
    result = invoke("audit", "verify", str(log_path))
    assert result.exit_code == 1 and "torn" in result.output and "line 7" in result.output


def test_verify_and_spend_find_the_log_through_a_config(tmp_path, log_path):
    config = tmp_path / "nowait.yaml"
    config.write_text(f"audit_log: {log_path}\n")
    assert invoke("audit", "verify", "--config", str(config)).exit_code == 0
    assert json.loads(invoke("audit", "spend", "-c", str(config), "--json").stdout)["total"]["requests"] == ENTRIES


def test_a_missing_log_is_a_usage_error(tmp_path):
    for command in ("verify", "spend"):
        result = invoke("audit", command, str(tmp_path / "none.jsonl"))
        assert result.exit_code == 2 and "no audit log" in result.output


# --- spend ---


def test_spend_by_tenant_sums_what_each_request_cost(tmp_path):
    path = tmp_path / "audit.jsonl"
    costs = two_tenant_run(path)
    report = json.loads(invoke("audit", "spend", str(path), "--json").stdout)
    assert set(report["rows"]) == {"team-a", "team-b"}
    for tenant, paid in costs.items():
        row = report["rows"][tenant]
        assert row["cost_usd"] == pytest.approx(sum(paid)) and row["requests"] == len(paid)
    assert report["rows"]["team-b"]["errors"] == 1 and report["rows"]["team-a"]["errors"] == 0
    # team-a: "Name: Ann" (9) on ar, then "x" (1) on diffusion and again on ar: 9 + 1 + 1 prompt tokens.
    assert report["rows"]["team-a"]["prompt_tokens"] == 11 and report["rows"]["team-a"]["completion_tokens"] == 9
    assert report["total"]["cost_usd"] == pytest.approx(sum(map(sum, costs.values())))
    table = invoke("audit", "spend", str(path))
    assert table.exit_code == 0 and "team-a" in table.output and f"{sum(costs['team-b']):.6f}" in table.output


def test_spend_by_engine_splits_the_same_total_across_the_runs(tmp_path):
    path = tmp_path / "audit.jsonl"
    costs = two_tenant_run(path)
    report = json.loads(invoke("audit", "spend", str(path), "--by", "engine", "--json").stdout)
    runs = [run for entry in read_audit_log(path) for run in entry["engines_tried"]]
    for engine in ("ar", "diffusion"):
        mine = [run for run in runs if run["engine"] == engine]
        assert report["rows"][engine]["requests"] == len(mine)
        assert report["rows"][engine]["cost_usd"] == pytest.approx(sum(run["cost_usd"] for run in mine))
    assert report["rows"]["diffusion"]["requests"] == 2 and report["rows"]["ar"]["requests"] == 4  # 2 + 2 re-runs
    assert report["total"]["cost_usd"] == pytest.approx(sum(map(sum, costs.values())))


def test_spend_since_leaves_out_what_ended_before(tmp_path):
    path = tmp_path / "audit.jsonl"
    two_tenant_run(path)
    entries = read_audit_log(path)
    entries[0]["time"] = entries[0]["time"] - 86400  # as if a day older: spend reads times, not the chain
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    from datetime import UTC, datetime

    cut = datetime.fromtimestamp(entries[1]["time"] - 3600, UTC).replace(tzinfo=None).isoformat()
    report = json.loads(invoke("audit", "spend", str(path), "--since", cut, "--json").stdout)
    assert report["total"]["requests"] == len(entries) - 1
    assert report["rows"]["team-a"]["cost_usd"] == pytest.approx(sum(e["cost_usd"] for e in entries[1:]
                                                                     if e["tenant"] == "team-a"))
    assert invoke("audit", "spend", str(path), "--since", "yesterday").exit_code == 2


def test_every_entry_names_its_tenant_and_key_id(tmp_path):
    path = tmp_path / "audit.jsonl"
    two_tenant_run(path)
    assert [(e["tenant"], e["key_id"]) for e in read_audit_log(path)] == [
        ("team-a", "key-team-a"), ("team-b", "key-team-b"), ("team-a", "key-team-a"), ("team-b", "key-team-b"),
        ("team-b", "key-team-b")]
