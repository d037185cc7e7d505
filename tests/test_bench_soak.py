"""`nowait bench soak`: a short run against a real gateway process on tiny models gives every key,
and its batch-line tally comes from the output files (one line dropped and one repeated on the
way in are counted as exactly one lost and one duplicated); the trend and the tally on their own."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from nowait.bench.load_http import BatchClient
from nowait.bench.soak_probe import Sample, tally, trend
from nowait.cli import app
from tests.gateway_support import base_config, free_port, save_tiny_models


def series(values: list[int]) -> list[Sample]:
    return [Sample(float(i), v, 10, 4, 1000, 0, 0) for i, v in enumerate(values)]


def test_a_flat_series_levels_off_and_a_growing_one_does_not():
    mib = 2**20
    flat = trend(series([100 * mib, 140 * mib, 150 * mib, 150 * mib, 151 * mib, 150 * mib, 150 * mib]), "rss_bytes")
    growing = trend(series([100 * mib + i * 10 * mib for i in range(7)]), "rss_bytes")
    assert flat["levels_off"] and abs(flat["second_half_growth_pct"]) < 1
    assert not growing["levels_off"]
    # second half: t = 3..6, 130 -> 160 MiB
    assert abs(growing["second_half_growth_pct"] - 100 * 30 / 130) < 1e-3  # rounded to 3 places
    assert growing["per_hour"] == 10 * mib * 3600


def test_the_tally_counts_lost_duplicated_and_extra_answers():
    accepted = {"b1": ["a", "b", "c"], "b2": ["d"], "b3": []}
    assert tally(accepted, {"b1": ["c", "a", "b"], "b2": ["d"]}) == (0, 0)
    assert tally(accepted, {"b1": ["a", "b"], "b2": ["d", "d"]}) == (1, 1)
    assert tally(accepted, {"b1": ["a", "b", "c"], "b3": ["x"]}) == (1, 1)  # b2 never answered; b3 answered a stranger


def test_a_short_soak_against_a_gateway_process(tmp_path, codec, monkeypatch):
    models = save_tiny_models(tmp_path / "models", codec)
    config = base_config(models, tmp_path / "unused", free_port(), defaults={"max_tokens": 4, "data_class": "internal"})
    config["engines"] = {name: config["engines"][name] for name in ("ar", "diffusion")}
    config_path = tmp_path / "nowait.yaml"
    config_path.write_text(yaml.safe_dump(config))

    # The client side of the tally sees one answer dropped and one repeated; whatever the server
    # itself loses or repeats comes on top of these.
    entries, tampered = BatchClient.entries, []

    async def tampered_entries(self, batch):
        lines = await entries(self, batch)
        if len(lines) >= 2 and len(tampered) < 2:
            tampered.append(batch["id"])
            return lines[1:] if len(tampered) == 1 else [*lines, lines[0]]
        return lines

    monkeypatch.setattr(BatchClient, "entries", tampered_entries)
    result = CliRunner().invoke(app, ["bench", "soak", "--minutes", "0.15", "--sample-interval", "1", "--json",
                                      "--config", str(config_path), "--max-tokens", "4", "--batch-lines", "3",
                                      "--concurrency", "2", "--startup-timeout", "120"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    for key in ("rss_growth_pct", "server_errors", "lines_lost", "lines_duplicated", "samples"):
        assert key in report
    assert len(tampered) == 2, "the run made fewer than two batches with answers"
    assert report["lines_lost"] == 1 and report["lines_duplicated"] == 1
    assert report["server_errors"] == 0 and report["transport_errors"] == 0
    assert len(report["samples"]) >= 5 and all(s["rss_bytes"] > 0 and s["open_fds"] > 0 for s in report["samples"])
    kinds = report["requests"]
    assert kinds["unknown_model"] == {"404": kinds["unknown_model"]["404"]}
    assert all(status.startswith("4") for status in kinds["malformed"])
    assert kinds["stream_dropped"].get("200") and kinds["responses_dropped"].get("200")
    assert set(report["trends"]) == {"rss_bytes", "open_fds", "threads", "store_bytes", "audit_bytes", "queued"}
