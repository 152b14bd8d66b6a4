"""`mpinfer run`: hashing, skipping, resuming and forcing, with small real stages and the engine stage."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mpinfer.errors import InvalidInputError, MpinferError
from mpinfer.pipeline import Stage, StageContext, StageOutput, StagePlan, run_pipeline
from mpinfer.pipeline_stages import default_stages, resolve_section
from tests.conftest import ROOT, assert_user_error
from tests.engine.conftest import make_mixed_model


def _plan_scale(ctx: StageContext) -> StagePlan:
    settings, inputs = resolve_section(ctx, ctx.section)
    return StagePlan(settings, tuple(inputs))


def _run_scale(plan: StagePlan, out: Path) -> StageOutput:
    data = np.load(plan.settings["data"])
    path = out / "scaled.npy"
    np.save(path, data * plan.settings.get("factor", 2))
    return StageOutput({"scaled": path}, {"n": int(data.size)})


def _plan_total(ctx: StageContext) -> StagePlan:
    src = ctx.artefacts["scaled"]
    return StagePlan({"source": str(src), "offset": ctx.section.get("offset", 0)}, (src,))


def _run_total(plan: StagePlan, out: Path) -> StageOutput:
    if plan.settings["offset"] == "boom":
        raise MpinferError("stage total failed on purpose")
    total = float(np.load(plan.settings["source"]).sum()) + plan.settings["offset"]
    path = out / "total.json"
    path.write_text(json.dumps({"total": total}))
    return StageOutput({"total": path}, {"total": total, "passed": total < 1000})


REGISTRY = {
    "scale": Stage("scale", _plan_scale, _run_scale),
    "total": Stage("total", _plan_total, _run_total),
}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    np.save(tmp_path / "data.npy", np.arange(4, dtype=np.float32))
    (tmp_path / "p.toml").write_text(
        '[pipeline]\nwork_dir = "work"\n\n[scale]\ndata = "data.npy"\nfactor = 3\n\n[total]\noffset = 1\n'
    )
    return tmp_path / "p.toml"


def _statuses(result):
    return [(s.name, s.status) for s in result.stages]


def _total(result) -> float:
    return json.loads(result.artefacts["total"].read_text())["total"]


def test_first_run_runs_then_rerun_skips(project):
    first = run_pipeline(project, registry=REGISTRY)
    assert _statuses(first) == [("scale", "ran"), ("total", "ran")] and _total(first) == 19.0
    again = run_pipeline(project, registry=REGISTRY)
    assert _statuses(again) == [("scale", "skipped"), ("total", "skipped")]
    assert again.artefacts == first.artefacts and again.stages[1].summary["total"] == 19.0
    state = json.loads(first.state_path.read_text())
    assert set(state["stages"]) == {"scale", "total"}


def test_artefacts_are_content_addressed(project):
    result = run_pipeline(project, registry=REGISTRY)
    folder = result.artefacts["scaled"].parent
    assert folder.parent.name == "artefacts" and folder.name == f"scale-{result.stages[0].key[:12]}"


def test_changed_input_file_reruns_downstream(project):
    run_pipeline(project, registry=REGISTRY)
    np.save(project.parent / "data.npy", np.arange(5, dtype=np.float32))
    result = run_pipeline(project, registry=REGISTRY)
    assert _statuses(result) == [("scale", "ran"), ("total", "ran")] and _total(result) == 31.0


def test_changed_setting_reruns_only_that_stage(project):
    first = run_pipeline(project, registry=REGISTRY)
    project.write_text(project.read_text().replace("offset = 1", "offset = 2"))
    result = run_pipeline(project, registry=REGISTRY)
    assert _statuses(result) == [("scale", "skipped"), ("total", "ran")] and _total(result) == 20.0
    project.write_text(project.read_text().replace("offset = 2", "offset = 1"))  # back: the old key is reused
    back = run_pipeline(project, registry=REGISTRY)
    assert _statuses(back) == [("scale", "skipped"), ("total", "skipped")]
    assert back.artefacts["total"] == first.artefacts["total"]


def test_damaged_artefact_is_rebuilt(project):
    first = run_pipeline(project, registry=REGISTRY)
    first.artefacts["scaled"].write_bytes(b"damaged")
    result = run_pipeline(project, registry=REGISTRY)
    assert _statuses(result) == [("scale", "ran"), ("total", "skipped")]
    assert np.load(result.artefacts["scaled"]).tolist() == [0, 3, 6, 9]


def test_force_reruns_everything(project):
    run_pipeline(project, registry=REGISTRY)
    assert _statuses(run_pipeline(project, registry=REGISTRY, force=True)) == [
        ("scale", "ran"),
        ("total", "ran"),
    ]


def test_failed_stage_resumes_after_the_last_finished_one(project):
    project.write_text(project.read_text().replace("offset = 1", 'offset = "boom"'))
    with pytest.raises(MpinferError, match="on purpose"):
        run_pipeline(project, registry=REGISTRY)
    leftovers = list((project.parent / "work" / "artefacts").glob("total-*"))
    assert leftovers == []  # no half-written output folder
    project.write_text(project.read_text().replace('offset = "boom"', "offset = 1"))
    assert _statuses(run_pipeline(project, registry=REGISTRY)) == [("scale", "skipped"), ("total", "ran")]


def test_passed_flag_comes_from_stage_summaries(project):
    assert run_pipeline(project, registry=REGISTRY).passed
    project.write_text(project.read_text().replace("offset = 1", "offset = 5000"))
    assert not run_pipeline(project, registry=REGISTRY).passed


def test_bad_pipeline_files(tmp_path):
    with pytest.raises(InvalidInputError, match="no such file"):
        run_pipeline(tmp_path / "missing.toml", registry=REGISTRY)
    (tmp_path / "bad.toml").write_text("[scale\n")
    with pytest.raises(InvalidInputError, match="invalid TOML"):
        run_pipeline(tmp_path / "bad.toml", registry=REGISTRY)
    (tmp_path / "typo.toml").write_text("[scael]\n")
    with pytest.raises(InvalidInputError, match=r"table\(s\) \[scael\].*did you mean \[scale\]"):
        run_pipeline(tmp_path / "typo.toml", registry=REGISTRY)
    (tmp_path / "empty.toml").write_text('[pipeline]\nwork_dir = "w"\n')
    with pytest.raises(InvalidInputError, match="no stage tables"):
        run_pipeline(tmp_path / "empty.toml", registry=REGISTRY)


def test_real_engine_stage_builds_once(tmp_path):
    make_mixed_model(tmp_path / "m.fp16.onnx")
    toml = tmp_path / "p.toml"
    toml.write_text(
        '[pipeline]\nwork_dir = "out"\n\n[build_engine]\nmodel = "m.fp16.onnx"\nbackend = "onnxruntime"\n'
        'device = "cpu"\nshapes = "x:1x8,4x8,16x8"\n'
    )
    first = run_pipeline(toml)
    engine = first.artefacts["engine"]
    assert engine.suffix == ".ort" and json.loads(first.artefacts["engine_sidecar"].read_text())[
        "backend"
    ] == ("onnxruntime")
    assert _statuses(run_pipeline(toml)) == [("build_engine", "skipped")]
    make_mixed_model(tmp_path / "m.fp16.onnx", low="fp32")  # new model content: rebuilt
    assert _statuses(run_pipeline(toml)) == [("build_engine", "ran")]


def test_stage_settings_are_checked(tmp_path):
    make_mixed_model(tmp_path / "m.onnx")
    toml = tmp_path / "p.toml"
    toml.write_text('[build_engine]\nmodel = "m.onnx"\nbackend = "onnxruntime"\nwarp_speed = 9\n')
    with pytest.raises(InvalidInputError, match="unknown key.*warp_speed"):
        run_pipeline(toml)


def test_report_dir_must_stay_inside_the_work_dir(tmp_path):
    toml = tmp_path / "p.toml"
    toml.write_text('[pipeline]\nwork_dir = "w"\n[report]\ndir = ".."\n')
    with pytest.raises(InvalidInputError, match="sub-folder of the work dir"):
        run_pipeline(toml)


@pytest.mark.parametrize("folder", ["artefacts", "artefacts/report", "pipeline-state.json"])
def test_report_dir_must_not_replace_the_artefacts(tmp_path, folder):
    """The report folder is deleted before each run: it must not be the stages' artefact store."""
    toml = tmp_path / "p.toml"
    toml.write_text(f'[pipeline]\nwork_dir = "w"\n[report]\ndir = "{folder}"\n')
    with pytest.raises(InvalidInputError, match="sub-folder of the work dir"):
        run_pipeline(toml)


def test_default_registry_order():
    assert list(default_stages()) == ["train", "export", "convert", "build_engine", "compare", "report"]


def test_run_command(invoke, tmp_path):
    make_mixed_model(tmp_path / "m.fp16.onnx")
    toml = tmp_path / "p.toml"
    toml.write_text('[build_engine]\nmodel = "m.fp16.onnx"\nbackend = "onnxruntime"\ndevice = "cpu"\n')
    first = invoke("run", toml)
    assert first.exit_code == 0, first.output
    assert "build_engine  ran in" in first.output and "engine" in first.output
    second = invoke("run", toml)
    assert "build_engine  skipped (unchanged)" in second.output
    assert "ran in" in invoke("run", toml, "--force").output


def test_run_command_bad_toml(invoke, tmp_path):
    toml = tmp_path / "p.toml"
    toml.write_text("[build_engine\n")
    assert_user_error(invoke("run", toml), "invalid TOML")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('pipeline = 3\n[scale]\ndata = "data.npy"\n', r"pipeline = 3.*a \[pipeline\] table"),
        ('scale = "data.npy"\n', r"scale = 'data.npy'.*a \[scale\] table"),
        ('[pipeline]\nwork-dir = "w"\n[scale]\ndata = "data.npy"\n',
         r"\[pipeline\]: received unknown key 'work-dir'.*did you mean 'work_dir'"),
        ('[pipeline]\nwork_dir = ["w"]\n[scale]\ndata = "data.npy"\n', r"work_dir = \['w'\].*a string"),
    ],
)
def test_malformed_tables_are_user_errors(tmp_path, text, match):
    np.save(tmp_path / "data.npy", np.arange(4, dtype=np.float32))
    (tmp_path / "p.toml").write_text(text)
    with pytest.raises(InvalidInputError, match=match):
        run_pipeline(tmp_path / "p.toml", registry=REGISTRY)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.npy", "p.toml"]  # no work dir made


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ('[export]\nsource = 3\n', r"\[export\] source = 3: received an integer, expected a string"),
        ('[export]\nsource = "m.py"\nopset = "17"\n', r"\[export\] opset = '17'.*expected an integer"),
        ('[compare]\ncandidates = "m.onnx"\n', r"\[compare\] candidates = 'm.onnx'.*expected a list"),
        ('[build_engine]\nmodel = "m.onnx"\ndevice = 3\n', r"\[build_engine\] device = 3.*a string"),
        ('[report]\nformats = "md"\n', r"\[report\] formats = 'md'.*expected a list"),
        # values the stages parse from strings are parsed up front too
        ('[convert]\nmodel = "m.onnx"\nbudget = "cosine>="\n', r"\[convert\] budget = 'cosine>=': .*cosine>="),
        ('[convert]\nmodel = "m.onnx"\nprecision = "fp8"\n', r"\[convert\] precision = 'fp8': .*fp16"),
        ('[compare]\nbaseline = "m.onnx"\nchecks = "cosine>>1"\n', r"\[compare\] checks = 'cosine>>1'"),
    ],
)
def test_wrong_value_types_are_refused_before_any_stage_runs(tmp_path, table, match):
    """A typo in a late table fails at once, not after training and export have run."""
    (tmp_path / "p.toml").write_text(f'[pipeline]\nwork_dir = "w"\n[train]\nmodel = "nope.py"\n{table}')
    with pytest.raises(InvalidInputError, match=match):
        run_pipeline(tmp_path / "p.toml")


def test_unknown_key_in_a_late_table_is_refused_before_any_stage_runs(tmp_path):
    (tmp_path / "p.toml").write_text('[train]\nmodel = "nope.py"\n[compare]\nchecks = "cosine>=0.9"\nbogus = 1\n')
    with pytest.raises(InvalidInputError, match=r"\[compare\]: received unknown key 'bogus'"):
        run_pipeline(tmp_path / "p.toml")


def test_run_output_has_no_stray_progress_lines(invoke, tmp_path):
    """Stage progress bars (convert, compare) must not leave blank lines among the stage lines."""
    make_mixed_model(tmp_path / "m.onnx", low="fp32")
    toml = tmp_path / "p.toml"
    toml.write_text(
        '[convert]\nmodel = "m.onnx"\ncalibration = "random:2"\n[compare]\nbaseline = "m.onnx"\ndata = "random:2"\n'
    )
    result = invoke("-q", "run", toml)
    assert result.exit_code == 0, result.output
    assert "" not in result.stdout.splitlines(), result.stdout


def test_compare_without_a_baseline_names_the_missing_key(tmp_path):
    make_mixed_model(tmp_path / "m.fp16.onnx")
    toml = tmp_path / "p.toml"
    toml.write_text('[compare]\ncandidates = ["m.fp16.onnx"]\n')
    with pytest.raises(InvalidInputError, match=r"\[compare\]: received no 'baseline' and no earlier stage"):
        run_pipeline(toml)


def test_a_work_dir_that_cannot_be_made_is_a_user_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "p.toml").write_text('[pipeline]\nwork_dir = "afile/w"\n[convert]\nmodel = "m.onnx"\n')
    with pytest.raises(InvalidInputError, match=r"work_dir .*cannot be written"):
        run_pipeline(tmp_path / "p.toml")


def test_a_root_that_is_not_a_folder_is_a_user_error(tmp_path):
    (tmp_path / "p.toml").write_text('[pipeline]\nroot = "nowhere"\n[convert]\nmodel = "m.onnx"\n')
    with pytest.raises(InvalidInputError, match=r"root = 'nowhere'.*not a folder"):
        run_pipeline(tmp_path / "p.toml")
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("data = 5", r"\[train\] data = 5: received an integer, expected a string"),
        ('eval_data = ["d"]', r"\[train\] eval_data = \['d'\].*expected a string"),
    ],
)
def test_train_data_in_a_toml_is_a_name_or_a_file(tmp_path, line, match):
    (tmp_path / "p.toml").write_text(f'[train]\nmodel = "m.py"\n{line}\n')
    with pytest.raises(InvalidInputError, match=match):
        run_pipeline(tmp_path / "p.toml")


def test_an_interrupted_train_stage_continues_where_it_stopped(tmp_path, monkeypatch):
    # Ctrl-C after epoch 1 of 2: the next `run` resumes from the stage folder's last.pt (epoch 1 is not
    # trained again), where it used to delete the folder and train from scratch.
    from mpinfer.train.trainer import AmpTrainer

    toml = tmp_path / "p.toml"
    rng = np.random.default_rng(0)  # 160 digits-shaped samples: the resume is under test, not the learning
    np.savez(tmp_path / "d.npz", x=rng.random((160, 1, 8, 8), dtype=np.float32), _labels=np.arange(160) % 10)
    toml.write_text(
        f'[pipeline]\nwork_dir = "w"\n[train]\nmodel = "{ROOT / "models" / "digits_cnn.py"}:build"\n'
        f'data = "{tmp_path / "d.npz"}"\nprecision = "fp32"\nepochs = 2\nbatch_size = 64\n'
    )
    fit = AmpTrainer.fit

    def interrupted(self, **kw):
        fit(self, stop_after_epoch=1)
        raise KeyboardInterrupt

    monkeypatch.setattr(AmpTrainer, "fit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(toml)
    [folder] = (tmp_path / "w" / "artefacts").iterdir()
    first = (folder / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in first] == [1]
    monkeypatch.setattr(AmpTrainer, "fit", fit)
    result = run_pipeline(toml)
    assert [r.status for r in result.stages] == ["ran"]
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [1, 2] and lines[0] == first[0]  # epoch 1 kept as it was
    # --force starts over, even from a kept folder
    monkeypatch.setattr(AmpTrainer, "fit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(toml, force=True)
    assert [json.loads(x)["epoch"] for x in (folder / "metrics.jsonl").read_text().splitlines()] == [1]
