"""The evaluation runner end to end on the tiny random model: results folders, skip/resume, identical inputs across
methods, reports, clear errors, and a 2-process ``accelerate launch`` split that matches the 1-process run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core_kv.config import load_config
from core_kv.eval import benchmarks as bm
from core_kv.eval.benchmarks import EmptyDatasetError
from core_kv.eval.runner import EvalConfig, cell_dir, method_spec, run_eval
from core_kv.eval.schema import Sample
from core_kv.files import read_jsonl
from core_kv.models.loading import ContextWindowError
from core_kv.presses import PRESSES
from tests.helpers import eval_argv, eval_samples, locked_by_another

ROOT = Path(__file__).resolve().parents[1]
CELLS = [("full", 0.0), ("knorm", 0.25), ("knorm", 0.5), ("snapkv", 0.25), ("snapkv", 0.5)]


def _cfg(data: Path, out: Path, *extra: str) -> EvalConfig:
    return load_config(EvalConfig, eval_argv(data, out, *extra))


def _folder_contents(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.parent != out / "plots" and p.name not in ("report.md", "results.json")
    }


@pytest.fixture(scope="module")
def clean_run(toy_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    return out, run_eval(_cfg(toy_data, out))


def test_smoke_two_presses_two_ratios(clean_run):
    out, res = clean_run
    assert [(c["method"], c["ratio"]) for c in res.cells] == CELLS
    for method, ratio in CELLS:
        folder = cell_dir(out, "toy", "tiny", method, ratio)
        assert sorted(p.name for p in folder.iterdir()) == ["config.yaml", "metrics.json", "predictions.jsonl"]
        rows = read_jsonl(folder / "predictions.jsonl")
        assert [r["sample_id"] for r in rows] == [0, 1, 2, 3]
        assert [r["group_id"] for r in rows] == [0, 0, 1, 2]  # the shared context is one group
        metrics = json.loads((folder / "metrics.json").read_text())
        assert metrics["num_samples"] == 4 and metrics["num_contexts"] == 3
        assert set(metrics["tasks"]) == {"code", "city"}
        assert metrics["model_label"] == "tiny random model (not the proxy)"
        assert "press:" in (folder / "config.yaml").read_text()
    # the reference exists once (ratio 0), not per ratio
    assert len(list(out.glob("toy__tiny-random__full__*"))) == 1
    # identical token ids for every method, and real savings in the stored payload
    by_cell = {c: read_jsonl(cell_dir(out, "toy", "tiny", *c) / "predictions.jsonl") for c in CELLS}
    hashes = {c: [r["input_hash"] for r in rows] for c, rows in by_cell.items()}
    assert len({tuple(h) for h in hashes.values()}) == 1 and len(set(hashes[CELLS[0]])) == 4
    full_kv = by_cell[("full", 0.0)][0]["kv_bytes"]
    assert by_cell[("knorm", 0.5)][0]["kv_bytes"] < by_cell[("knorm", 0.25)][0]["kv_bytes"] < full_kv
    # reports
    assert (out / "report.md").read_text() == res.markdown
    needles = ["tiny random model (not the proxy)", "| snapkv |", "KV payload", "aux"]
    needles += ["| full (reference) ⚠ below the floor |", "**Warnings (⚠):**"]  # random weights answer nothing
    for needle in needles:
        assert needle in res.markdown
    png = out / "plots" / "curves__toy.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rerun_skips_finished_cells(clean_run, toy_data, monkeypatch):
    out, res = clean_run
    before = _folder_contents(out)

    def boom(self, job):
        raise AssertionError("a finished cell was recomputed")

    monkeypatch.setattr(bm.Benchmark, "evaluate_group", boom)
    again = run_eval(_cfg(toy_data, out))
    assert again.cells == res.cells and again.markdown == res.markdown
    assert _folder_contents(out) == before


def test_interrupted_run_resumes_to_identical_results(clean_run, toy_data, tmp_path, monkeypatch):
    clean_out, _ = clean_run
    out = tmp_path / "crashy"
    calls = {"n": 0}
    original = bm.Benchmark.evaluate_group

    def crash_on_fifth(self, job):  # cell 1 (3 groups) done, then 1 group of cell 2, then "killed"
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return original(self, job)

    monkeypatch.setattr(bm.Benchmark, "evaluate_group", crash_on_fifth)
    with pytest.raises(KeyboardInterrupt):
        run_eval(_cfg(toy_data, out))
    crashed = cell_dir(out, "toy", "tiny", "knorm", 0.25)
    assert not (crashed / "metrics.json").exists() and not (crashed / "predictions.jsonl").exists()
    partial = crashed / "predictions.partial.rank0.jsonl"
    assert len(partial.read_text().splitlines()) == 1
    with open(partial, "a") as f:  # a torn line, as if killed mid-append
        f.write('{"group": 1, "rows": [{"sampl')

    monkeypatch.setattr(bm.Benchmark, "evaluate_group", original)
    calls["n"] = 0
    counting = bm.Benchmark.evaluate_group

    def count(self, job):
        calls["n"] += 1
        return counting(self, job)

    monkeypatch.setattr(bm.Benchmark, "evaluate_group", count)
    run_eval(_cfg(toy_data, out))
    assert calls["n"] == 3 * len(CELLS) - 3 - 1  # neither the finished cell nor the finished group reran
    assert _folder_contents(out) == _folder_contents(clean_out)


def test_changed_config_in_same_folder_raises(clean_run, toy_data):
    out, _ = clean_run
    with pytest.raises(ValueError, match="different configuration"):
        run_eval(_cfg(toy_data, out, "generation.max_new_tokens=4"))


def _written_before(clean_run, tmp_path, line: str):
    """A copy of the clean run whose knorm 0.5 cell's config.yaml lacks ``line`` (as written before that option
    existed): ``(folder, config path, the config's text as written)``."""
    import shutil

    out = tmp_path / "old"
    shutil.copytree(clean_run[0], out)
    cfg_path = cell_dir(out, "toy", "tiny", "knorm", 0.5) / "config.yaml"
    text = cfg_path.read_text()
    assert line in text
    cfg_path.write_text(text.replace(line, ""))
    return out, cfg_path, text


def test_folder_written_before_an_option_existed_is_still_finished(clean_run, toy_data, tmp_path):
    """A cell's config.yaml that lacks an option which now exists at its default is the same cell (an upgrade does
    not orphan finished results); the option at another value, or any other change, is a different cell."""
    out, cfg_path, text = _written_before(clean_run, tmp_path, "  compress_questions: false\n")
    before = _folder_contents(out)
    run_eval(_cfg(toy_data, out))  # every cell finished: nothing recomputed or rewritten
    assert _folder_contents(out) == before
    with pytest.raises(ValueError, match="different configuration"):
        run_eval(_cfg(toy_data, out, "methods=[knorm]", "ratios=[0.5]", "generation.compress_questions=true"))
    cfg_path.write_text(text.replace("  compress_questions: false\n", "").replace("seed: 42", "seed: 41"))
    with pytest.raises(ValueError, match="different configuration"):
        run_eval(_cfg(toy_data, out, "methods=[knorm]", "ratios=[0.5]"))


def test_folder_decoded_before_the_eos_rule_is_refused_unless_asked_for(clean_run, toy_data, tmp_path):
    """A cell written before ``generation.min_new_tokens`` existed stopped on a first-token eos (the rule 0): under
    the default 1 its answers may differ, so it is a different cell; ``min_new_tokens=0`` reuses it."""
    out, cfg_path, text = _written_before(clean_run, tmp_path, "  min_new_tokens: 1\n")
    with pytest.raises(ValueError, match="different configuration"):
        run_eval(_cfg(toy_data, out, "methods=[knorm]", "ratios=[0.5]"))
    before = _folder_contents(out)
    run_eval(_cfg(toy_data, out, "methods=[knorm]", "ratios=[0.5]", "generation.min_new_tokens=0", "reference=false"))
    assert _folder_contents(out) == before  # finished under the rule it was computed with: nothing recomputed


def test_clear_errors(toy_data, tmp_path):
    with pytest.raises(ValueError, match="unknown method 'nope'.*registered presses"):
        _cfg(toy_data, tmp_path, "methods=[nope]")
    with pytest.raises(ValueError, match="unknown benchmark 'nobench'"):
        _cfg(toy_data, tmp_path, "datasets.toy.kind=nobench")
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['nope'\]"):
        run_eval(_cfg(toy_data, tmp_path, "datasets.toy.tasks=[nope]"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(EmptyDatasetError, match="no samples"):
        run_eval(_cfg(empty, tmp_path, f"datasets.toy.source={empty}"))
    with pytest.raises(ContextWindowError, match="context window is 8192"):
        run_eval(_cfg(toy_data, tmp_path, "datasets.toy.lengths=[100000]"))
    with pytest.raises(ValueError, match=r"ratios\[0\] must be in \(0, 1\)"):
        _cfg(toy_data, tmp_path, "ratios=[1.0]")


def test_wandb_offline_tracker(toy_data, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_eval(_cfg(toy_data, tmp_path / "out", "tracker.name=wandb", "methods=[knorm]", "ratios=[0.5]"))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_two_cpu_processes_match_one(toy_data, tmp_path):
    """``accelerate launch`` with 2 gloo processes on CPU (env.md §5) splits contexts and merges on the main process.

    The one-process run is a fresh process too: the tiny random model's logits are nearly tied, and the same eval run
    inside this long-lived test process has decoded other greedy tokens after earlier tests (twice in 2026-12, both
    runs in fresh processes agreeing), so the comparison is between two fresh processes."""
    clean_out, out = tmp_path / "one", tmp_path / "two"
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    single = subprocess.run([sys.executable, "eval.py", *eval_argv(toy_data, clean_out)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=240)  # fmt: skip
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--num_cpu_threads_per_process", "1", "eval.py", *eval_argv(toy_data, out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "processes: 2" in proc.stdout
    two, one = _folder_contents(out), _folder_contents(clean_out)
    assert two.keys() == one.keys()
    for name in two:
        if name.endswith("predictions.jsonl"):
            a, b = read_jsonl(out / name), read_jsonl(clean_out / name)
            assert [r["input_hash"] for r in a] == [r["input_hash"] for r in b]
            assert [r["prediction"] for r in a] == [r["prediction"] for r in b], name


@pytest.mark.slow  # a subprocess start costs 10-40 s on a busy 2-core machine; the in-process crash test covers the logic
def test_sigkill_mid_grid_then_rerun_matches(clean_run, toy_data, tmp_path):
    """A real ``kill -9`` while a cell is half done: the rerun completes to byte-identical results folders."""
    import signal
    import time

    clean_out, _ = clean_run
    out = tmp_path / "killed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, "eval.py", *eval_argv(toy_data, out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    partial = cell_dir(out, "toy", "tiny", "knorm", 0.5) / "predictions.partial.rank0.jsonl"
    deadline = time.time() + 120
    while not partial.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    if proc.poll() is not None:
        pytest.skip("the run finished before it could be killed mid-cell")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (partial.parent / "metrics.json").exists()
    run_eval(_cfg(toy_data, out))
    assert _folder_contents(out) == _folder_contents(clean_out)


def test_method_labels_and_report_table(toy_data, tmp_path):
    from core_kv.eval.report import markdown_report
    from core_kv.eval.runner import _build_press

    cfg = _cfg(toy_data, tmp_path, "methods=[ada_snapkv]", "press_options.ada_snapkv={kind: adakv, press: snapkv}")
    press = _build_press(cfg, "ada_snapkv", 0.5)
    assert press.name == "adakv" and press.press.name == "snapkv" and press.compression_ratio == 0.5

    def cell(method, ratio, avg, aux):
        return {"benchmark": "b", "method": method, "ratio": ratio, "average": avg, "tasks": {"t1": avg, "t2": avg},
                "kv_bytes": 2048.0 * (1 - ratio), "aux_bytes": aux, "context_tokens": 100.0, "num_samples": 2,
                "num_contexts": 1, "average_label": "mean", "higher_is_better": True, "kind": "jsonl"}  # fmt: skip

    md = markdown_report(
        [cell("full", 0.0, 90.0, 0), cell("core", 0.5, 80.0, 3 * 1024), cell("core", 0.75, 60.5, 0)], "m"
    )
    assert "| full (reference) | 90.00 | 90.00 |" in md
    assert "| core | 80.00 | 60.50 |" in md
    assert "| core | 0.50 | 80.00 | 80.00 | 80.00 | 1.0 KiB | 3.0 KiB | 100 |" in md


def test_report_flags_a_full_cache_reference_below_the_floor():
    """Compression cannot be ranked where the uncompressed model fails (issue 47: SmolLM2's NIAH full cache at 0 and
    KeyDiff at 66.7): the benchmark's table and the report's head warn, and low tasks are marked in their column."""
    from core_kv.eval.report import markdown_report, reference_warnings

    def cell(bench, method, ratio, tasks, unit="score (0-100)", hib=True):
        avg = sum(tasks.values()) / len(tasks)
        return {"benchmark": bench, "method": method, "ratio": ratio, "average": avg, "tasks": tasks, "kv_bytes": 1.0,
                "aux_bytes": 0, "context_tokens": 10.0, "num_samples": 2, "num_contexts": 1, "average_label": "mean",
                "higher_is_better": hib, "unit": unit, "kind": "jsonl"}  # fmt: skip

    cells = [
        cell("niah", "full", 0.0, {"niah": 0.0}), cell("niah", "keydiff", 0.75, {"niah": 66.7}),
        cell("ruler", "full", 0.0, {"a": 100.0, "b": 20.0}), cell("ruler", "snapkv", 0.75, {"a": 50.0, "b": 30.0}),
        cell("fid", "full", 0.0, {"f": 0.0}, unit="KL", hib=False), cell("fid", "knorm", 0.5, {"f": 0.3}, "KL", False),
    ]  # fmt: skip
    warns = reference_warnings(cells, 40.0)
    assert sorted(warns) == ["niah", "ruler"]  # the KL benchmark is never flagged
    assert "scores 0.00 < 40" in warns["niah"][0] and len(warns["niah"]) == 1
    assert warns["ruler"] == ["ruler: tasks whose full-cache score is below 40 cannot rank methods: b 20.00"]
    md = markdown_report(cells, "m")
    assert md.index("**Warnings") < md.index("## niah")
    assert "| full (reference) ⚠ below the floor | 0.00 |" in md
    assert "| full (reference) | 60.00 |" in md  # ruler's average passes; only its task b is marked
    assert "| method | ratio | a | b ⚠ | average |" in md
    assert reference_warnings(cells, 0.0) == {}


def test_a_table_of_few_contexts_says_it_cannot_rank_methods():
    """The default suite's NIAH has 6 contexts per cell (issue 59): its table says one context moves a score by 17
    points; a table of 48 contexts carries no caveat."""
    from core_kv.eval.report import markdown_report

    def cell(method, ratio, n):
        return {"benchmark": "niah", "method": method, "ratio": ratio, "average": 50.0, "tasks": {"niah": 50.0},
                "kv_bytes": 1.0, "aux_bytes": 0, "context_tokens": 10.0, "num_samples": n, "num_contexts": n,
                "average_label": "mean", "higher_is_better": True, "kind": "jsonl"}  # fmt: skip

    few = markdown_report([cell("full", 0.0, 6), cell("knorm", 0.75, 6)], "m")
    assert ("6 samples over 6 contexts per cell. ⚠ Too few to rank methods: one context moves a score by 17 points and "
            "a 95% interval around 50% spans ±40") in few  # fmt: skip
    assert "Too few" not in markdown_report([cell("full", 0.0, 48), cell("knorm", 0.75, 48)], "m")


def test_tied_points_are_drawn_side_by_side_and_others_stay_put():
    """Markers at equal values hid each other (issue 47): ties get distinct offsets, centred, at most ``spread`` wide."""
    from core_kv.eval.report import MARKERS, dodge

    series = {"a": [(0.5, 20.0), (0.75, 10.0)], "b": [(0.5, 20.0), (0.75, 0.0)], "c": [(0.5, 20.0), (0.75, 5.0)]}
    off = dodge(series, step=0.02, spread=0.1)
    assert [off[(m, 0.5)] for m in "abc"] == pytest.approx([-0.02, 0.0, 0.02])
    assert all(off[(m, 0.75)] == 0.0 for m in "abc")
    many = {str(i): [(0.9, 0.0)] for i in range(26)}
    wide = dodge(many, step=0.02, spread=0.1)
    xs = sorted(wide.values())
    assert len(set(xs)) == 26 and xs[-1] - xs[0] == pytest.approx(0.1) and sum(xs) == pytest.approx(0.0)
    assert len(set(MARKERS)) == len(MARKERS) >= 10


def test_eval_py_output_ends_with_its_warnings_then_the_report_and_plots(toy_data, tmp_path, capsys, monkeypatch):
    """The last lines of ``python eval.py`` say where the report and the plots went, after the floor warnings."""
    import runpy

    out = tmp_path / "cli"
    monkeypatch.setattr(sys, "argv", ["eval.py", *eval_argv(toy_data, out, "methods=[knorm]", "ratios=[0.5]")])
    runpy.run_path(str(ROOT / "eval.py"), run_name="__main__")
    tail = capsys.readouterr().out.rstrip().splitlines()[-3:]
    assert tail[0].startswith("⚠ toy: the full cache (no compression) scores")  # the tiny model answers nothing
    assert tail[1] == f"report: {out / 'report.md'} (tables; every cell's numbers in results.json)"
    assert tail[2].startswith(f"plots:  {out / 'plots'}/ (1 PNG: curves__toy.png)")
    assert (out / "report.md").is_file() and (out / "plots" / "curves__toy.png").is_file()


def test_press_options_of_methods_not_in_the_run_are_dropped_with_a_warning():
    """A shipped grid config narrowed on the command line (methods=[snapkv]) keeps working."""
    with pytest.warns(UserWarning, match=r"ignored: \['core'\]"):
        cfg = load_config(
            EvalConfig, ["methods=[snapkv]", "press_options={core: {checkpoint: x}, snapkv: {window_size: 8}}"]
        )
    assert cfg.press_options == {"snapkv": {"window_size": 8}}


CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted((CONFIGS / "eval").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_eval_yaml_loads(path):
    """Every shipped evaluation config names registered presses and benchmarks and valid options."""
    cfg = load_config(EvalConfig, [str(path)])
    assert cfg.methods or cfg.reference
    for name in cfg.methods:
        kind, _ = method_spec(name, cfg.press_options.get(name))
        assert kind in PRESSES, f"{path.name}: unknown press {kind!r}"


@pytest.mark.parametrize("path", sorted((CONFIGS / "proxy").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_proxy_yaml_loads(path):
    from core_kv.proxy.train import ProxyTrainConfig

    cfg = load_config(ProxyTrainConfig, [str(path)])
    assert cfg.phases and all(p.min_len <= p.max_len for p in cfg.phases)


# ---------------------------------------------------------------------------------------------------------------
# Issue 16


@pytest.mark.parametrize(
    "option", ["datasets.ruler.num_samples=0", "datasets.ruler.num_samples=-3", "datasets.niah.lengths=[0]",
               "datasets.niah.num_samples=0", "datasets.toy.num_samples=0"]
)  # fmt: skip
def test_zero_or_negative_counts_are_errors(option, toy_data):
    """num_samples=0 silently ran 500 RULER samples per cell (``or 500``); counts must be >= 1, null means all."""
    key = option.split("=")[0].split(".")[-1]
    extra = ["benchmarks=[ruler,niah]"] if "toy" not in option else [f"datasets.toy.source={toy_data}"]
    with pytest.raises(ValueError, match=rf"{option.split('=')[0].replace('.', '[.]')}|{key}.*>= 1"):
        load_config(EvalConfig, ["model.name=tiny", *extra, option])
    assert (
        load_config(EvalConfig, ["model.name=tiny", "datasets.ruler.num_samples=null"]).datasets["ruler"].num_samples
        is None
    )


def test_truncated_metrics_json_is_recomputed_with_a_warning(clean_run, toy_data, tmp_path):
    """A finished cell whose metrics.json was truncated is treated as unfinished (recomputed), naming the file."""
    import shutil

    clean_out, res = clean_run
    out = tmp_path / "truncated"
    shutil.copytree(clean_out, out)
    metrics = cell_dir(out, "toy", "tiny", "knorm", 0.5) / "metrics.json"
    metrics.write_text(metrics.read_text()[:20])
    with pytest.warns(UserWarning, match=str(metrics)):
        again = run_eval(_cfg(toy_data, out))
    assert again.cells == res.cells
    assert json.loads(metrics.read_text()) == json.loads(
        (cell_dir(clean_out, "toy", "tiny", "knorm", 0.5) / "metrics.json").read_text()
    )


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "eval").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_eval_configs_load_and_build_every_press(path):
    """Every shipped eval config parses into :class:`EvalConfig`, and each of its methods builds with its options
    (labelled variants such as ``core_adaptive`` included), so a typo fails here rather than hours into a grid."""
    from core_kv.eval.runner import _build_press

    cfg = load_config(EvalConfig, [str(path)])
    ratio = (cfg.ratios or [0.5])[0]
    for method in cfg.methods:
        assert _build_press(cfg, method, ratio).compression_ratio == ratio, method


def test_plot_grid_script_reads_cells_and_writes_png(tmp_path):
    """scripts/plot_grid.py: a CSV of measured cells becomes cells for the shared plot; bad CSVs name the line."""
    import runpy

    mod = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "plot_grid.py"))
    good = tmp_path / "grid.csv"
    good.write_text(
        "method,ratio,average,results\nfull,0,76.0,results/a\nkeydiff,0.75,25.0,results/b\nkeydiff,0.9,14.6,results/b\n"
    )
    cells = mod["read_cells"](good)
    assert [(c["method"], c["ratio"], c["average"]) for c in cells] == [
        ("full", 0.0, 76.0),
        ("keydiff", 0.75, 25.0),
        ("keydiff", 0.9, 14.6),
    ]
    png = mod["main"]([str(good), str(tmp_path / "g.png"), "--title", "t"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.csv"
    bad.write_text("method,ratio,average\nkeydiff,0.75,n/a\n")
    with pytest.raises(ValueError, match=r"bad.csv:2"):
        mod["read_cells"](bad)
    (tmp_path / "cols.csv").write_text("method,score\nfull,1\n")
    with pytest.raises(ValueError, match="missing column"):
        mod["read_cells"](tmp_path / "cols.csv")
    # a needle grid: a length column switches to score vs length, one panel per ratio
    grid = tmp_path / "needles.csv"
    grid.write_text(
        "method,ratio,length,average\nfull,0,1024,90\nfull,0,2048,80\ncore,0.75,1024,50\n"
        "core,0.75,2048,40\ncore,0.9,1024,20\n"
    )
    cells = mod["read_cells"](grid)
    assert [(c["method"], c["ratio"], c["length"]) for c in cells][2:4] == [("core", 0.75, 1024), ("core", 0.75, 2048)]
    png = mod["main"]([str(grid), str(tmp_path / "n.png")])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "badlen.csv").write_text("method,ratio,length,average\ncore,0.75,2k,50\n")
    with pytest.raises(ValueError, match=r"badlen.csv:2"):
        mod["read_cells"](tmp_path / "badlen.csv")
    (tmp_path / "refonly.csv").write_text("method,ratio,length,average\nfull,0,1024,90\n")
    with pytest.raises(ValueError, match="ratio > 0"):
        mod["main"]([str(tmp_path / "refonly.csv"), str(tmp_path / "r.png")])


def test_compress_questions_prefills_each_question_with_its_context(clean_run, toy_data, tmp_path):
    """The question-aware protocol: the press compresses context + question; only suffix + answer prefix follow."""
    from core_kv.eval.runner import _sha256_ids
    from core_kv.models.loading import load_model
    from core_kv.pipeline import encode

    agnostic_out, _ = clean_run
    out = tmp_path / "aware"
    run_eval(_cfg(toy_data, out, "methods=[knorm]", "ratios=[0.5]", "generation.compress_questions=true"))
    folder = cell_dir(out, "toy", "tiny", "knorm", 0.5)
    rows = read_jsonl(folder / "predictions.jsonl")
    agnostic = read_jsonl(cell_dir(agnostic_out, "toy", "tiny", "knorm", 0.5) / "predictions.jsonl")
    assert json.loads((folder / "metrics.json").read_text())["num_contexts"] == 4  # the shared context splits in two
    assert [r["group_id"] for r in rows] == [0, 1, 2, 3] and all(r["question"] == "" for r in rows)
    _, tokenizer = load_model("tiny")
    for s, r, a in zip(eval_samples(), rows, agnostic, strict=True):
        enc = encode(tokenizer, s.context + s.question, [""], [s.answer_prefix])
        c_ids, q_ids = enc.context_ids[0].tolist(), enc.question_ids[0][0].tolist()
        assert r["input_hash"] == _sha256_ids(c_ids + [-1] + q_ids) != a["input_hash"]
        assert r["context_tokens"] == len(c_ids) > a["context_tokens"]  # the question was compressed with it
        assert r["kv_bytes"] > a["kv_bytes"]


def test_compress_questions_leaves_question_free_samples_alone():
    from core_kv.eval.benchmarks import GenerationConfig

    s = eval_samples()[0]
    assert GenerationConfig().fed(s) is s
    aware = GenerationConfig(compress_questions=True)
    assert aware.fed(s).context == s.context + s.question and aware.fed(s).question == ""
    blank = Sample("toy", "lm", s.context, "", "", [], 8, "string_match_all", 256)
    assert aware.fed(blank) is blank


def test_a_second_run_with_other_methods_reports_every_finished_cell(clean_run, toy_data, tmp_path):
    """A second eval.py with other methods into the same output_dir rewrote report.md / results.json with its own
    rows only; both now cover every finished cell of the folder (the earlier run's are read, not recomputed)."""
    import shutil

    clean_out, res = clean_run
    out = tmp_path / "shared"
    shutil.copytree(clean_out, out)
    again = run_eval(_cfg(toy_data, out, "methods=[streaming_llm]", "ratios=[0.75]"))
    got = [(c["method"], c["ratio"]) for c in again.cells]
    assert got == [("full", 0.0), ("streaming_llm", 0.75), *sorted(CELLS[1:])]
    stored = json.loads((out / "results.json").read_text())
    assert [(c["method"], c["ratio"]) for c in stored["cells"]] == got
    report = (out / "report.md").read_text()
    for row in ("| full (reference)", "| knorm |", "| snapkv |", "| streaming_llm |"):
        assert row in report
    assert report.count("| knorm | ") == 3  # the grid row and one detail row per ratio
    assert "| streaming_llm | 0.75 |" in report and "| 0.25 | 0.50 | 0.75 |" in report


def test_ratio_labels_round_trip_in_folders_and_report(toy_data, tmp_path):
    """0.125 was labelled 0.12 (folder and report); 0.75 and 0.7549 shared a folder."""
    res = run_eval(_cfg(toy_data, tmp_path, "methods=[knorm]", "ratios=[0.125,0.75,0.7549]", "plots=false"))
    assert sorted(p.name.rsplit("__", 1)[1] for p in tmp_path.glob("toy__*")) == ["0.00", "0.125", "0.75", "0.7549"]
    assert "| method | 0.125 | 0.75 | 0.7549 |" in res.markdown
    assert "| knorm | 0.125 |" in res.markdown


def test_damaged_results_files_are_named_and_the_cell_recomputed_or_refused(clean_run, toy_data, tmp_path):
    """``metrics.json = {}`` failed with ``KeyError: 'benchmark'``, a garbage ``config.yaml`` with
    ``UnicodeDecodeError``; neither named the file."""
    import shutil

    clean_out, res = clean_run
    out = tmp_path / "damaged"
    shutil.copytree(clean_out, out)
    metrics = cell_dir(out, "toy", "tiny", "snapkv", 0.25) / "metrics.json"
    for content in ("{}", "[1, 2]", json.dumps({**json.loads(metrics.read_text()), "method": "knorm"})):
        metrics.write_text(content)
        with pytest.warns(UserWarning, match=rf"{metrics} is unreadable .* recomputed"):
            again = run_eval(_cfg(toy_data, out))
        assert again.cells == res.cells
    config = cell_dir(out, "toy", "tiny", "knorm", 0.5) / "config.yaml"
    before = {p: p.read_bytes() for p in config.parent.iterdir()}
    for garbage in (bytes(range(256)), b"a: [unclosed\n"):
        config.write_bytes(garbage)
        with pytest.raises(ValueError, match=rf"{config}: unreadable .*delete {config.parent}"):
            run_eval(_cfg(toy_data, out))
        assert (config.parent / "metrics.json").read_bytes() == before[config.parent / "metrics.json"]


def test_a_second_evaluation_into_a_folder_being_written_is_refused(toy_data, tmp_path):
    from core_kv.lock import LOCK_NAME, FolderLocked

    tmp_path.mkdir(exist_ok=True)
    with locked_by_another(tmp_path, "evaluation", "eval.py") as pid:
        with pytest.raises(FolderLocked, match=rf"being written by another evaluation \(pid {pid}"):
            run_eval(_cfg(toy_data, tmp_path))
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]
    run_eval(_cfg(toy_data, tmp_path, "methods=[knorm]", "ratios=[0.5]", "plots=false"))  # the owner is gone: stale
    assert not (tmp_path / LOCK_NAME).exists()


def test_every_benchmark_is_loaded_before_any_cell_runs(toy_data, tmp_path):
    """A bad second benchmark (here a missing source) used to fail after the first benchmark's cells had run."""
    with pytest.raises(FileNotFoundError, match="no JSONL samples at"):
        run_eval(_cfg(toy_data, tmp_path, "benchmarks=[toy,other]", "datasets.other.kind=jsonl",
                      f"datasets.other.source={tmp_path / 'missing.jsonl'}"))  # fmt: skip
    assert not list(tmp_path.glob("toy__*"))


def test_a_finished_cells_damaged_predictions_are_recomputed(clean_run, toy_data, tmp_path):
    """The report's per-cell figures read predictions.jsonl back: a damaged one is found when the run starts (named,
    the cell recomputed), not at the end of the run."""
    import shutil

    clean_out, res = clean_run
    out = tmp_path / "preds"
    shutil.copytree(clean_out, out)
    predictions = cell_dir(out, "toy", "tiny", "knorm", 0.25) / "predictions.jsonl"
    for damage in (bytes(range(200)), predictions.read_bytes()[:-10], b""):
        predictions.write_bytes(damage)
        with pytest.warns(UserWarning, match=rf"{predictions} is unreadable"):
            again = run_eval(_cfg(toy_data, out))
        assert again.cells == res.cells
    assert (
        predictions.read_bytes()
        == (cell_dir(clean_out, "toy", "tiny", "knorm", 0.25) / "predictions.jsonl").read_bytes()
    )


def test_a_reference_with_non_finite_logits_is_not_stored_and_the_repaired_rerun_computes_it(
    clean_run, toy_data, tmp_path, monkeypatch
):
    """With NaN weights the full-cache cell was stored as finished (prediction '!', score 0) before the press
    refused; after the weights were repaired the rerun skipped it."""
    import torch

    from core_kv.eval import runner

    clean_out, _ = clean_run
    out = tmp_path / "nan"
    real = runner.load_model

    def broken(*args, **kwargs):
        model, tok = real(*args, **kwargs)
        with torch.no_grad():
            model.get_input_embeddings().weight.fill_(float("nan"))
        return model, tok

    monkeypatch.setattr(runner, "load_model", broken)
    with pytest.raises(FloatingPointError, match="non-finite logits .* nothing is stored for this cell"):
        run_eval(_cfg(toy_data, out))
    reference = list(out.glob("toy__tiny-random__full__*"))
    assert len(reference) == 1  # the reference runs first: its folder holds its config, nothing else
    for folder in reference:
        assert not (folder / "metrics.json").exists() and not (folder / "predictions.jsonl").exists()
        assert not any(p.read_text().strip() for p in folder.glob("predictions.partial.rank*.jsonl"))
    monkeypatch.setattr(runner, "load_model", real)
    run_eval(_cfg(toy_data, out))  # repaired: every cell computed, the reference too
    assert _folder_contents(out) == _folder_contents(clean_out)


def test_result_files_get_the_umasks_modes(clean_run):
    """Each cell's metrics.json / predictions.jsonl, results.json and the report were 0600 under umask 022."""
    out, _ = clean_run
    mask = os.umask(0o022)
    os.umask(mask)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"metrics.json", "predictions.jsonl", "results.json", "report.md", "config.yaml"} <= {p.name for p in files}
    assert {str(p): p.stat().st_mode & 0o777 for p in files} == {str(p): 0o666 & ~mask for p in files}
