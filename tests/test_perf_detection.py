"""lmsys.perf.detection: the A/A false-alarm and injected-delay detection table, from the reruns' JSON."""

from pathlib import Path

from lmsys.perf import detection


def doc(verdicts: dict[str, str]) -> dict:
    return {"benchmarks": [{"name": name, "fullname": f"t.py::{name}", "extra_info": {"verdict": verdict}}
                           for name, verdict in verdicts.items()]}


def test_tally_counts_failing_verdicts_per_benchmark_and_over_all():
    results = {
        0.0: [doc({"a": "PASS", "b": "PASS"}), doc({"a": "SLOWER", "b": "IMPROVED"})],
        0.05: [doc({"a": "SLOWER", "b": "SLOWER-EAGER"}), doc({"a": "SLOWER+MORE-MEMORY", "b": "PASS", "c": "NEW"})],
    }
    table = detection.tally(results)
    assert list(table.columns) == ["benchmark", "A/A false alarms", "+5% caught"]
    assert table.values.tolist() == [["a", "1/2", "2/2"], ["b", "0/2", "1/2"], ["all", "1/4", "3/4"]]


def test_main_saves_a_reference_then_reruns_each_case_with_the_delay(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_rerun(args, runs, cwd, env=None, timeout=None, progress=None):
        calls.append((list(args), runs, env))
        if any(arg.startswith("--benchmark-save=") for arg in args):
            storage = Path(next(a for a in args if a.startswith("--benchmark-storage=")).split("=", 1)[1])
            (storage / "GPU").mkdir(parents=True)
            return [doc({})]
        storage = Path(next(a for a in args if a.startswith("--benchmark-storage=")).split("=", 1)[1])
        assert (storage / "GPU" / "calibration.json").exists()  # the GPU's calibration applies to the reruns too
        caught = "SLOWER" if float(env[detection.INJECT_DELAY]) > 0 else "PASS"
        return [doc({"test_x": caught})] * runs

    (tmp_path / "baselines" / "GPU").mkdir(parents=True)
    (tmp_path / "baselines" / "GPU" / "calibration.json").write_text("{}")
    monkeypatch.setattr(detection.reruns, "rerun", fake_rerun)
    assert detection.main(["--runs", "3", "--inject", "0.05", "--", "perf_tests", "-k", "x"]) == 0
    out = capsys.readouterr().out
    assert "test_x              0/3        3/3" in out
    reference, aa, injected = calls
    assert reference[0][:3] == ["perf_tests", "-k", "x"] and reference[1] == 1
    assert aa[0][-1] == "--benchmark-compare" and aa[2] == {detection.INJECT_DELAY: "0.0"} and aa[1] == 3
    assert injected[2] == {detection.INJECT_DELAY: "0.05"}


def test_main_compares_with_a_named_baseline_when_asked(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(detection.reruns, "rerun", lambda args, runs, cwd, env=None, timeout=None: calls.append(args)
                        or [doc({"test_x": "PASS"})] * runs)
    assert detection.main(["--runs", "2", "--inject", "0.1", "--baseline", "7", "--markdown", "--", "perf_tests"]) == 0
    assert calls[0][-2:] == ["--benchmark-storage=baselines", "--benchmark-compare=7"]
    assert "| test_x | 0/2 | 0/2 |" in capsys.readouterr().out
