import json
from pathlib import Path

import pytest

from peagle.bench.measurement import Measurement
from peagle.bench.plots import plot_all
from peagle.bench.report import (
    ENVIRONMENT_KEYS,
    POINT_KEYS,
    TOP_KEYS,
    ResultsWriter,
    load_results,
    make_point,
    markdown,
    summary_line,
)

SCHEMA_DOC = Path(__file__).resolve().parents[2] / "docs" / "BENCH_SCHEMA.md"


def measurement(tokens_per_s: float, al: float | None = None, num_prompts: int = 8) -> Measurement:
    return Measurement(
        num_prompts=num_prompts, num_failed=0, output_tokens=int(tokens_per_s * 10), wall_s=10.0,
        tokens_per_s=tokens_per_s, acceptance_length=al, per_position_acceptance=[0.8, 0.5] if al else [],
        draft_acceptance_rate=0.4 if al else None, ttft_p50_ms=5.0, ttft_p99_ms=9.0, itl_p50_ms=1.0, itl_p99_ms=2.0,
    )


def sample_points() -> list[dict]:
    return [
        make_point("mtbench", "none", None, 1, measurement(100.0)),
        make_point("mtbench", "eagle3", 3, 1, measurement(200.0, 2.5)),
        make_point("mtbench", "eagle3", 5, 1, measurement(180.0, 2.7)),
        make_point("mtbench", "peagle", 3, 1, measurement(250.0, 2.9)),
        make_point("mtbench", "peagle", 7, 1, measurement(330.0, 3.7)),
        make_point("mtbench", "peagle", 7, 4, measurement(0.0, None, num_prompts=0)),  # every request failed
        make_point("mtbench", "hf_static_compile", None, 1, measurement(30.0)),
    ]


def test_schema_keys_are_stable_and_documented(tmp_path):
    # Changing any of these is a schema change: bump SCHEMA_VERSION and update docs/BENCH_SCHEMA.md.
    assert TOP_KEYS == ("schema_version", "kind", "created_utc", "command", "config", "environment", "points")
    assert POINT_KEYS == (
        "dataset", "method", "k", "adaptive", "temperature", "concurrency", "num_prompts", "num_failed",
        "output_tokens", "wall_s", "tokens_per_s", "acceptance_length", "per_position_acceptance",
        "draft_acceptance_rate", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "verified_per_round",
        "accepted_per_round", "verified_per_accepted", "flags", "remeasured",
    )
    writer = ResultsWriter(tmp_path, "peagle bench --model m", {"max_tokens": 256})
    writer.add(sample_points()[1])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert tuple(saved) == TOP_KEYS
    assert tuple(saved["environment"]) == ENVIRONMENT_KEYS
    assert saved["schema_version"] == 2 and saved["kind"] == "peagle-bench"
    assert tuple(saved["points"][0]) == POINT_KEYS
    assert load_results(tmp_path / "results.json") == saved
    doc = SCHEMA_DOC.read_text()
    for key in (*TOP_KEYS, *POINT_KEYS, *ENVIRONMENT_KEYS):
        assert f"`{key}`" in doc, key


def test_load_results_refuses_other_files(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"points": []}))
    with pytest.raises(ValueError, match="not a peagle bench results file"):
        load_results(path)
    path.write_text("{truncated")
    with pytest.raises(ValueError, match="not a JSON file"):
        load_results(path)


def test_markdown_table_picks_best_k_and_speedups():
    results = {"command": "peagle bench", "config": {"max_tokens": 256}, "environment": {"gpu": "NVIDIA H200"},
               "points": sample_points()}
    text = markdown(results)
    assert text.startswith("# peagle bench: NVIDIA H200")
    assert ("| concurrency | no speculation tok/s | EAGLE-3 tok/s | P-EAGLE tok/s | P-EAGLE / EAGLE-3 | "
            "P-EAGLE / no speculation | EAGLE-3 / no speculation |") in text
    # EAGLE-3 at its best K (3, not 5), P-EAGLE at its best K (7); concurrency 4 had only failures: no row.
    assert "| 1 | 100.0 | 200.0 (K=3, AL 2.50) | 330.0 (K=7, AL 3.70) | 1.65x | 3.30x | 2.00x |" in text
    assert "| 4 |" not in text
    assert "| HF static cache + compile | 1 | 8 | 30.0 | 11.00x |" in text
    assert "| P-EAGLE | 2.90 | - | 3.70 |" in text and "| EAGLE-3 | 2.50 | 2.70 | - |" in text


def test_a_best_k_at_the_edge_of_what_was_measured_there_is_marked():
    # EAGLE-3 was swept at K 5 and 7 at concurrency 1 but at K 3 too at 16; P-EAGLE at K 5 and 7 at 1, K 11 elsewhere.
    # At 1 EAGLE-3's best measured K (5) is the smallest measured there and K=3 was not: its best may be K=3, so the
    # ratio against it is a bound. Interior or run-wide edges are not marked.
    points = [make_point("mtbench", "none", None, c, measurement(100.0 * c)) for c in (1, 16)]
    points += [make_point("mtbench", "eagle3", k, 1, measurement(r, 2.5)) for k, r in ((5, 170.0), (7, 160.0))]
    points += [make_point("mtbench", "peagle", k, 1, measurement(r, 2.5)) for k, r in ((5, 190.0), (7, 200.0))]
    points += [make_point("mtbench", "eagle3", k, 16, measurement(r, 2.5)) for k, r in ((3, 2500.0), (5, 2400.0))]
    points += [make_point("mtbench", "peagle", k, 16, measurement(r, 2.5)) for k, r in ((3, 2600.0), (11, 2000.0))]
    text = markdown({"command": "peagle bench", "config": {}, "environment": {}, "points": points})
    assert "| 1 | 100.0 | 170.0 (K=5, AL 2.50) * | 200.0 (K=7, AL 2.50) * |" in text
    assert "| 16 | 1600.0 | 2500.0 (K=3, AL 2.50) | 2600.0 (K=3, AL 2.50) |" in text
    assert "(EAGLE-3 at c=1: K 3 not measured here; P-EAGLE at c=1: K 11 not measured here)" in text
    assert "| c=1: P-EAGLE / EAGLE-3 | 1.18x * |" in text and "| c=16: P-EAGLE / EAGLE-3 | 1.04x |" in text
    assert "| P-EAGLE's best K at c=1 | 7 * |" in text


def test_summary_line_is_one_json_object():
    results = {"points": sample_points()}
    line = summary_line(results, {"results": "r.json", "markdown": "r.md", "plots": ["a.png"]})
    assert "\n" not in line
    summary = json.loads(line)
    assert summary["results"] == "r.json" and summary["num_points"] == 7
    assert summary["speedup_peagle_vs_eagle3"] == {"mtbench": {"1": 1.65}}
    assert summary["speedup_peagle_vs_none"] == {"mtbench": {"1": 3.3}}


def test_plots_cover_what_was_measured(tmp_path):
    points = [p for p in sample_points() if p["method"] != "eagle3"]
    written = plot_all({"points": points}, tmp_path)
    # No EAGLE-3 points: no P-EAGLE / EAGLE-3 speed-up plot.
    assert [p.name for p in written] == ["throughput_mtbench.png", "acceptance_vs_k.png",
                                         "acceptance_by_position.png"]
    for png in written:
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 100_000


def test_conditional_acceptance_by_position():
    from peagle.bench.plots import conditional_acceptance

    assert conditional_acceptance([0.8, 0.4, 0.1]) == [0.8, 0.5, 0.25]
    assert conditional_acceptance([0.5, 0.0, 0.0]) == [0.5, 0.0, None]  # none accepted draft 2: draft 3 undefined
    assert conditional_acceptance([]) == []


def test_acceptance_by_position_needs_per_position_rates(tmp_path):
    from peagle.bench.plots import plot_per_position

    points = [{**p, "per_position_acceptance": []} for p in sample_points()]
    assert plot_per_position(points, tmp_path / "a.png") is None and not (tmp_path / "a.png").exists()
    assert plot_per_position(sample_points(), tmp_path / "b.png") == tmp_path / "b.png"


def test_schema_1_files_load_as_schema_2(tmp_path):
    v1_point = {key: value for key, value in sample_points()[3].items()
                if key not in ("adaptive", "temperature", "flags", "remeasured")}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"schema_version": 1, "kind": "peagle-bench", "command": "peagle bench --adaptive 8:7",
                                "config": {"adaptive": [[8, 7]], "adaptive_above": 0}, "environment": {},
                                "points": [v1_point, sample_points()[0]]}))
    results = load_results(path)
    assert results["schema_version"] == 2 and all(tuple(p) == POINT_KEYS for p in results["points"])
    peagle, none = results["points"]
    assert peagle["adaptive"] == {"thresholds": [[8, 7]], "above": 0} and none["adaptive"] is None
    assert peagle["temperature"] == 0.0 and peagle["flags"] == [] and peagle["remeasured"] is None


def test_bench_report_merges_runs_split_over_calls(tmp_path, capsys):
    from peagle.cli import main

    slower_again = make_point("mtbench", "none", None, 1, measurement(90.0))  # measured again by run b
    for name, points in (("a", sample_points()[:3]), ("b", [*sample_points()[3:], slower_again])):
        writer = ResultsWriter(tmp_path / name, f"peagle bench --part {name}", {"max_tokens": 256}, env={"gpu": None})
        for p in points:
            writer.add(p)
    assert main(["bench-report", str(tmp_path / "a" / "results.json"), str(tmp_path / "b" / "results.json"),
                 "--out", str(tmp_path / "all")]) == 0
    merged = load_results(tmp_path / "all" / "results.json")
    assert len(merged["points"]) == 7 and merged["config"]["merged_commands"] == [
        "peagle bench --part a", "peagle bench --part b"]
    assert "| 1 | 100.0 | 200.0 (K=3, AL 2.50) | 330.0 (K=7, AL 3.70) | 1.65x | 3.30x | 2.00x |" in (
        tmp_path / "all" / "results.md").read_text()
    assert main(["bench-report", str(tmp_path / "a" / "results.json"), str(tmp_path / "b" / "results.json")]) != 0
    assert "--out DIR" in capsys.readouterr().err


def test_bench_report_calibrates_from_saved_results(tmp_path):
    from peagle.cli import main

    writer = ResultsWriter(tmp_path / "run", "peagle bench", {"model": "m"}, env={"gpu": "test"})
    for c, (none, k3, k7) in {1: (100, 250, 330), 8: (700, 900, 800), 64: (4000, 3000, 2500)}.items():
        writer.add(make_point("mtbench", "none", None, c, measurement(none)))
        writer.add(make_point("mtbench", "peagle", 3, c, measurement(k3, 2.0)))
        writer.add(make_point("mtbench", "peagle", 7, c, measurement(k7, 3.0)))
    head = tmp_path / "head"
    head.mkdir()
    assert main(["bench-report", str(writer.path), "--calibrate", f"peagle={head}"]) == 0
    saved = json.loads((head / "adaptive.json").read_text())
    assert {k: saved[k] for k in ("thresholds", "above")} == {"thresholds": [[2, 7], [22, 3]], "above": 0}
    record = saved["calibration"]
    assert record["datasets"] == ["mtbench"] and record["temperatures"] == [0.0]
    assert "every compared K" in record["rule"]
    assert record["table"][0]["workloads"] == ["mtbench@0"]
    assert main(["bench-report", str(writer.path), "--calibrate", "peagle"]) != 0


def test_git_commit_comes_from_the_environment_for_a_copied_tree(monkeypatch, tmp_path):
    from peagle.bench import report

    monkeypatch.setenv(report.GIT_COMMIT_ENV, "0123abc\n")
    assert report._git_state(tmp_path) == ("0123abc", None)  # tmp_path is no checkout: the variable decided
    monkeypatch.delenv(report.GIT_COMMIT_ENV)
    assert report._git_state(tmp_path) == (None, None)


def test_against_the_seeds_summarises_the_headline_cells():
    points = sample_points() + [
        make_point("mtbench", "none", None, 64, measurement(4000.0)),
        make_point("mtbench", "eagle3", 3, 64, measurement(6000.0, 2.4)),
        make_point("mtbench", "peagle", 5, 64, measurement(6600.0, 2.6)),
        make_point("mtbench", "peagle", 7, 64, measurement(6300.0, 2.8)),
    ]
    for c, rate in ((1, 320.0), (64, 6500.0)):
        p = make_point("mtbench", "peagle", 7, c, measurement(rate, 3.6))
        p["adaptive"] = {"thresholds": [[1, 7]], "above": 5}
        points.append(p)
    text = markdown({"config": {}, "points": points})
    section = text[text.index("### Against the seeds (greedy)"):]
    assert "| cell | mtbench | seeds |" in section
    assert "| c=1: P-EAGLE / EAGLE-3 | 1.65x | 1.55-1.69x |" in section  # 330 / 200, each at its best K
    assert "| c=1: P-EAGLE / no speculation | 3.30x | 2.97-3.97x |" in section
    assert "| c=1: P-EAGLE / HF static cache + compile | 11.00x | - |" in section
    # K=5's 6,600 / 6,000; marked: at 64 EAGLE-3 ran K=3 alone and P-EAGLE K 5 and 7 (their best at the edge)
    assert "| c=64: P-EAGLE / EAGLE-3 | 1.10x * | 1.05-1.25x (c=64) |" in section
    assert "/ no speculation, c=64 | 1.62x | - |" in section and "/ no speculation, lowest | 1.62x (c=64) |" in section
    assert "| P-EAGLE's best K at c=1 | 7 | 7-11 |" in section
    # without P-EAGLE rows there is nothing to hold against the seeds
    assert "Against the seeds" not in markdown({"config": {}, "points": [p for p in points if p["method"] != "peagle"]})
